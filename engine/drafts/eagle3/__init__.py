"""EAGLE3: one Llama layer over fused aux features, a reduced draft vocabulary (`d2t`/`t2d`), the public
`LlamaForCausalLMEagle3` checkpoint format, trained with training-time test.

    head.py   Eagle3Head and its config.json (`eagle3_config`)
    plan.py   aux layer ids, fc width, vocabulary checks; its words in the plan line
    train.py  the TTT forward (engine/drafts/common/ttt.py)
    vocab.py  the reduced draft vocabulary from the training data
The draft loop is the EAGLE family's (engine/drafts/common/feature.py).
"""

from engine.drafts.base import Algorithm, FeatureKind
from engine.drafts.common.feature import make_feature
from engine.drafts.common.ttt import ttt_attention_flex
from engine.drafts.eagle3.head import Eagle3Head, eagle3_config
from engine.drafts.eagle3.plan import Eagle3Config, describe_eagle3, plan_eagle3
from engine.drafts.eagle3.train import ttt_forward
from engine.drafts.eagle3.vocab import fit_draft_vocab
from engine.drafts.train_contract import TrainSpec

ALGORITHM = Algorithm(
    config=Eagle3Config,
    name="eagle3",
    plan=plan_eagle3,
    make=make_feature,
    head=Eagle3Head,
    train=TrainSpec(
        FeatureKind.aux,
        ttt_forward,
        flex_attention=ttt_attention_flex,
        forward_ops=True,
        prepare=fit_draft_vocab,
        summary="A one-layer EAGLE-3 head in the public format (`{architecture}`: {tensors}), reading the target's "
        "hidden states after layers\n{aux_layer_ids_output_of} (`output_of` convention), {vocabulary}.\n{not_stored}",
    ),
    recipe="+experiment=train_eagle3_smollm2",
    describe=describe_eagle3,
)

__all__ = ["ALGORITHM", "Eagle3Head", "eagle3_config"]
