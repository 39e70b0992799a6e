"""Draft training (issue 5, in progress): self-distilled data from the target, the reduced draft vocabulary."""
