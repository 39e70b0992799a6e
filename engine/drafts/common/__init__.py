"""Pieces shared by the EAGLE-family drafts: the head base, the feature draft loop, TTT attention and the
plan checks of weighted heads."""
