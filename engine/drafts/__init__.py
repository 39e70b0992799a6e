"""Draft algorithms (EAGLE3, EAGLE, n-gram, oracle) behind one interface; see base.py and registry.py."""
