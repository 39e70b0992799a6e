"""Stage `configure_aux_capture`: turn on the target's capture of the aux layers the draft reads.

It runs in exactly one place in the plan: after `load` and before anything that captures graphs or
generates (sglang #22836: configured after graph capture, graphs replayed without aux outputs and
acceptance fell to zero; a workaround then set default ids and ignored configured ones). The ids were
resolved at plan time (`draft.aux_layer_ids` > the checkpoint's `eagle_aux_hidden_state_layer_ids` >
the EAGLE3 default) and are applied here as they were validated, in the `input_of` convention.

Provides `aux_layers` (engine.aux_layers.AuxLayers); logs both conventions and the source.
"""

from __future__ import annotations

from stages.base import Stage, StageEnv, register_stage


@register_stage
class ConfigureAuxCaptureStage(Stage):
    name = "configure_aux_capture"
    requires = ("target",)
    provides = ("aux_layers",)

    @classmethod
    def needed(cls, cfg, draft) -> bool:
        return draft is not None and draft.aux is not None  # the draft reads aux layers

    def describe(self, cfg, env: StageEnv) -> str:
        return f"target aux layers: {env.draft_plan.aux.describe()}"

    def run(self, cfg, inputs, env: StageEnv) -> dict:
        aux = env.draft_plan.aux
        inputs["target"].model.set_aux_layers(aux.input_of)
        if env.tracker is not None:
            env.tracker.log_params(
                {
                    "aux_layer_ids.input_of": list(aux.input_of),
                    "aux_layer_ids.output_of": list(aux.output_of),
                    "aux_layer_ids.source": aux.source,
                }
            )
        print(f"[configure_aux_capture] {aux.describe()}", flush=True)
        return {"aux_layers": aux}
