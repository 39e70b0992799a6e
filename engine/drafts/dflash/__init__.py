"""DFlash: a block-diffusion drafter; one forward proposes a block of tokens, conditioned on the target's aux
features injected as extra keys and values (`DFlashDraftModel`, z-lab's layout).

    head.py   DFlashHead (context write, block forward), config.json and card text
    loop.py   DFlashDraft: context k/v in the prefill and each extend, one block per proposal
    plan.py   explicit target layers, block size, mask token; its words in the plan line
    train.py  every anchor's block at once (packed: the trained anchors' only), the train.* limits of a block
"""

from engine.drafts.base import Algorithm, FeatureKind
from engine.drafts.dflash.head import DFlashHead, dflash_config, dflash_value
from engine.drafts.dflash.loop import DFlashDraft, make_dflash
from engine.drafts.dflash.plan import DFlashConfig, describe_dflash, plan_dflash
from engine.drafts.dflash.train import check_dflash_training, dflash_forward, dflash_forward_packed
from engine.train.objective import TrainSpec

ALGORITHM = Algorithm(
    config=DFlashConfig,
    name="dflash",
    plan=plan_dflash,
    make=make_dflash,
    head=DFlashHead,
    train=TrainSpec(
        FeatureKind.aux,
        dflash_forward,
        forward_ops=True,
        packed_forward=dflash_forward_packed,
        check=check_dflash_training,
    ),
    recipe="+experiment=train_dflash_smollm2",
    describe=describe_dflash,
)

__all__ = ["ALGORITHM", "DFlashDraft", "DFlashHead", "dflash_config", "dflash_value"]
