"""Multi-layer EAGLE (MTP-style, `multi_layer_eagle`): one draft module per draft token, each with its own
KV pool, over the target's final hidden state (`LlamaForCausalLMMultiLayerEagle`).

    head.py   MultiLayerEagleHead (its modules and per-module KV pools) and its config.json
    loop.py   MultiLayerDraft: the proposal windows and the commit re-runs
    plan.py   k = draft.num_steps modules; a checkpoint's width and module count
    public.py MTP layers inside a target's checkpoint (MiMo, DeepSeek-V3 names) read as the modules
    train.py  every module teacher-forced over whole sequences
"""

from engine.drafts.base import Algorithm, FeatureKind
from engine.drafts.multi_layer.head import MultiLayerEagleHead, StepCaches, multi_layer_config
from engine.drafts.multi_layer.loop import MultiLayerDraft, make_multi_layer
from engine.drafts.multi_layer.plan import MultiLayerConfig, plan_multi_layer
from engine.drafts.multi_layer.train import multi_layer_forward
from engine.drafts.train_contract import TrainSpec

ALGORITHM = Algorithm(
    config=MultiLayerConfig,
    name="multi_layer_eagle",
    plan=plan_multi_layer,
    make=make_multi_layer,
    head=MultiLayerEagleHead,
    train=TrainSpec(
        FeatureKind.final,
        multi_layer_forward,
        summary="A multi-layer EAGLE (MTP-style) draft of {config[num_nextn_predict_layers]} modules "
        "(`{architecture}`: per module `enorm`, `hnorm`, `eh_proj`, one Llama decoder layer and "
        "`shared_head.norm`); module i reads module i-1's hidden state (module 0: the target's final hidden "
        "state) and proposes draft token i+1. {not_stored}",
        objective="Teacher-forced multi-token prediction, one module per draft position "
        "({config[num_nextn_predict_layers]} modules)",
    ),
    recipe="+experiment=train_mtp_smollm2",
)

__all__ = ["ALGORITHM", "MultiLayerDraft", "MultiLayerEagleHead", "StepCaches", "multi_layer_config"]
