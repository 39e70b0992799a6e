"""DFlash: a block-diffusion drafter; one forward proposes a block of tokens, conditioned on the target's aux
features injected as extra keys and values (`DFlashDraftModel`, z-lab's layout).

    head.py   DFlashHead (context write, block forward) and its config.json
    loop.py   DFlashDraft: context k/v in the prefill and each extend, one block per proposal
    plan.py   explicit target layers, block size, mask token; its words in the plan line
    train.py  every anchor's block at once (packed: the trained anchors' only), the train.* limits of a block
"""

from engine.drafts.base import Algorithm, FeatureKind
from engine.drafts.dflash.head import DFlashHead, dflash_config, dflash_value
from engine.drafts.dflash.loop import DFlashDraft, make_dflash
from engine.drafts.dflash.plan import DFlashConfig, describe_dflash, plan_dflash
from engine.drafts.dflash.train import check_dflash_training, dflash_forward, dflash_forward_packed
from engine.drafts.train_contract import TrainSpec

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
        summary="A DFlash block-diffusion drafter (`{architecture}`: `fc`, `hidden_norm`, {config[num_hidden_layers]} "
        "Llama layers `layers.*` with {config[num_key_value_heads]} key/value heads, `norm`):\none forward proposes "
        "the mask tokens of a block of {config[block_size]}, `[bonus, mask, ...]` (mask token id "
        "{config[mask_token_id]}), conditioned on the target's hidden states after layers\n"
        "{aux_layer_ids_output_of} (`output_of` convention), injected as extra keys and values into every "
        "layer{window}.\n{not_stored}",
        objective="The block of {config[block_size]} tokens of every answer anchor at once (exactly the attention "
        "of inference), block positions 1..{train[ttt_steps]}",
    ),
    recipe="+experiment=train_dflash_smollm2",
    describe=describe_dflash,
)

__all__ = ["ALGORITHM", "DFlashDraft", "DFlashHead", "dflash_config", "dflash_value"]
