"""EAGLE (EAGLE-1/2): one feature-level Llama layer over the target's final hidden state, predicting
through the target's lm_head (`LlamaForCausalLMEagle`), trained with training-time test.

    head.py   EagleHead and its config.json (`eagle_config`)
    plan.py   no aux layers; a checkpoint's vocabulary and fc width
    train.py  the TTT forward (engine/drafts/common/ttt.py)
The draft loop is the EAGLE family's (engine/drafts/common/feature.py).
"""

from engine.drafts.base import Algorithm, FeatureKind
from engine.drafts.common.feature import make_feature
from engine.drafts.common.ttt import ttt_attention_flex
from engine.drafts.eagle.head import EagleHead, eagle_config
from engine.drafts.eagle.plan import EagleConfig, plan_eagle
from engine.drafts.eagle.train import eagle_forward
from engine.drafts.train_contract import TrainSpec

ALGORITHM = Algorithm(
    config=EagleConfig,
    name="eagle",
    plan=plan_eagle,
    make=make_feature,
    head=EagleHead,
    train=TrainSpec(
        FeatureKind.final,
        eagle_forward,
        flex_attention=ttt_attention_flex,
        forward_ops=True,
        summary="A one-layer EAGLE head in the EAGLE reference layout (`{architecture}`: `fc` over the next token's "
        "embedding and the target's final hidden state, then `layers.0.*`, a decoder layer without an input norm). "
        "It predicts the next feature, which the target's lm_head reads. {not_stored}",
    ),
    recipe="+experiment=train_eagle_smollm2",
)

__all__ = ["ALGORITHM", "EagleHead", "eagle_config"]
