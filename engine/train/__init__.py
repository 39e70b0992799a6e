"""Draft training: self-distilled data from the target, the reduced draft vocabulary, the EAGLE3,
multi-layer and DFlash objectives and the shared trainer."""
