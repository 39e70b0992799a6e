"""Draft training shared by every algorithm: self-distilled data from the target (selfdistill.py, data.py),
the objective and held-out acceptance (objective.py), the trainer loop (trainer.py) and its weight average
(average.py). Each draft's own forward, checks and TrainSpec live in its folder under engine/drafts/."""
