"""Draft training shared by every algorithm: its settings (config.py, checks.py), self-distilled data from
the target (selfdistill.py, data.py), held-out acceptance (acceptance.py), the trainer loop (trainer.py),
its weight average (average.py) and the model card (card.py). The batch and loss every draft shares, and
each draft's own forward and TrainSpec, live under engine/drafts/ (train_contract.py, <name>/train.py)."""
