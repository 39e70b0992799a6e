"""`train.*`: the settings of stage `train_draft`, as the trainer and the self-distillation read them.

Declared once: the run schema's `train` node (stages/schema.py) is this dataclass, and the stage hands
it to `Trainer` and `synthesize` as it is. What no recipe or user sets is a constant of the code that
reads it (engine/train/selfdistill.py's SYNTHESIS, the trainer's GRAD_CLIP, the exported bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainDataConfig:
    """Self-distilled training data (engine/train/selfdistill.py), cached under the run's train dir."""

    num_samples: int = 4096  # samples to synthesise (train and held-out together)
    batch_size: int = 128  # generation batch (CUDA graphs on CUDA, eager elsewhere)
    max_prompt_tokens: int = 64  # the synthesised user message
    drop_cut_prompts: bool = False  # draw again the user messages cut at max_prompt_tokens (else answered)
    max_answer_tokens: int = 384  # the target's answer
    # System messages the user messages are written under, row by row ("": the template's default);
    # [] = the default only. They steer the topics (Magpie); answers are always under the default.
    system_prompts: list[str] = field(default_factory=list)
    min_prompt_chars: int = 16


@dataclass
class TrainConfig:
    """Stage `train_draft` (task=train_draft): self-distil, then train the draft head with TTT."""

    name: Optional[str] = None  # output folder under outputs/train (null: experiment_name)
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    heldout: float = 0.05  # fraction of samples held out for acceptance estimates
    steps: int = 2000  # optimizer steps (train.max_time_s may stop it sooner)
    lr: float = 5e-4  # AdamW's peak learning rate, after warmup_steps of linear warm-up
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio (0..1)
    weight_decay: float = 0.0  # AdamW's, on matrices only
    ttt_steps: int = 6  # draft steps unrolled on the draft's own outputs
    loss_decay: float = 0.8  # step s weighs decay ** s
    max_tokens: int = 16384  # padded tokens per batch
    max_len: int = 512  # sequences are cut here
    eval_every: int = 250  # steps between held-out evaluations (MLflow curves)
    save_every: int = 250  # steps between checkpoints (resume)
    eval_k: int = 5  # drafts per chain for the held-out accept_length
    # The training labels: the target's distribution over the draft vocabulary at this temperature,
    # softmax(z / T). Below 1 it leans toward the target's greedy token, the one greedy drafting is scored
    # on; the held-out figures (val_loss included) always use the target's own distribution (T = 1).
    label_temperature: float = 1.0
    # > 0: the exported head is an exponential moving average of the training weights at this decay
    # (0.999: about the last 1000 steps; engine/train/average.py), and the held-out figures are its; the
    # last step's own weights are exported beside it, to `head_last`, with their figures as `last_*`.
    # 0: off, the head is the last step's weights.
    ema_decay: float = 0.0
    attention: str = "auto"  # training forward: eager | flex (FlexAttention, CUDA only) | auto (flex where it can)
    # The training step's fused kernels: triton (one Triton kernel each way for the loss's soft
    # cross-entropy, from the label logits: kernels/soft_ce.py, and for the EAGLE3, EAGLE and DFLASH
    # heads' RMSNorms and RoPE: kernels/rms_norm.py, kernels/rope.py; CUDA, or CPU under
    # TRITON_INTERPRET=1) | torch (plain ops, with fp32 [positions, draft vocab] intermediates) | auto
    # (triton on CUDA where triton is installed, else torch).
    kernels: str = "auto"
    # After training: this many held-out prompts through the real draft-and-verify loop (k =
    # draft.num_steps, greedy, up to loop_eval_tokens new tokens); 0 skips it. loop_eval_tokens is also
    # the horizon of the loop replayed on every held-out answer at each evaluation
    # (val_loop_accept_length_k*): the eval stage's max_new_tokens, as the figure depends on it.
    loop_eval_prompts: int = 64
    loop_eval_tokens: int = 256
    max_time_s: Optional[float] = None  # stop (evaluate, save) after this much training time
    resume: bool = True  # continue from <train dir>/checkpoint when it exists
    export_dir: Optional[str] = None  # also copy the head here, replacing one there (relative: to the repo)
