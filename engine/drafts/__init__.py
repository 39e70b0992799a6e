"""Draft algorithms behind one interface, one folder each: eagle3/, eagle/, multi_layer/ (multi_layer_eagle),
dflash/, lookup/ (ngram, oracle); common/ holds the EAGLE family's shared head base, feature loop, TTT
attention and plan checks. See base.py (the interfaces and the `Algorithm` record) and registry.py (the table)."""
