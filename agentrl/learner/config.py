"""The learner's config section (`learner:`), in sub-sections: optim, schedule, loss, critic,
checkpoint, logging and warmstart, with the batch and model fields at its top.

    learner:
      model_path: runs/models/tiny
      groups_per_step: 8
      optim: {lr: 1.0e-5, max_grad_norm: 1.0}
      schedule: {warmup_steps: 10, lr_decay: cosine}
      loss: {advantage: grpo, policy_loss: ppo_clip, kl_coef: 0.0}
      checkpoint: {every: 50, keep: 2}

Keys of the old flat layout (`learner.lr`, `learner.checkpoint_every`, ...) are refused with an
error that names the new key (`MOVED`). `agentrl.config` re-exports these models; the resolved
config of a run is still one file (`config.resolved.yaml`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.learner.distill import DistillConfig
from agentrl.learner.lora import LoraConfig
from agentrl.section import Section


class OptimConfig(Section):
    """AdamW and gradient clipping."""

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (β1, β2)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""


class ScheduleConfig(Section):
    """The learning-rate schedule, in optimizer steps."""

    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate shape after warm-up, decaying to `min_lr_ratio`·lr at `max_steps`."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak (cosine / linear decay)."""


class LossConfig(Section):
    """The advantage estimator and the policy objective with its corrections and penalties."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "grpo_batch_std", "remax", "gae"] = "grpo"
    """Advantage estimator: GRPO, Dr. GRPO, RLOO, REINFORCE++ (batch mean and std), grpo_batch_std
    (group mean, batch std: TRL's `scale_rewards="batch"`), remax (the greedy episode's reward as
    the baseline: needs `roller.greedy_baseline: true`), or gae: PPO with a critic
    (`learner.critic`), GAE(gamma, lam) over token rewards; see docs/architecture.md."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE's discount γ per action token (advantage: gae)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's λ (advantage: gae)."""
    whiten_advantages: bool = True
    """advantage: gae: normalise the advantages over the batch's action tokens (TRL's
    `masked_whiten`)."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "sapo"] = "ppo_clip"
    """Policy objective: token-level PPO clip, GSPO's sequence-level ratio, CISPO (clipped
    importance-weight REINFORCE; uses clip_low / clip_high on the weight) or SAPO (soft gate)."""
    clip_low: float | None = Field(0.2, ge=0)
    """Lower clip range ε of the importance ratio (1 − ε). null: no lower bound, allowed with cispo
    only (MiniMax-M1's setting), and cispo's default when clip_low is not given, so that CISPO does
    not raise small weights up to 1 − ε."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip range (1 + ε_high); DAPO's clip-higher when above clip_low. With cispo and
    clip_low: null the weight is min(r, 1 + clip_high): TRL's `epsilon_high` is 1 + clip_high."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c (> 1) bounding the loss for negative advantages (ppo_clip and gspo;
    refused with cispo / sapo, which have no clip to bound); null disables."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """SAPO's gate temperature for positive advantages."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """SAPO's gate temperature for negative advantages."""
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    """How per-token losses are aggregated into the batch loss. Left unset with `policy_loss: gspo`
    it is `seq_mean_token_mean` (GSPO's sequence mean); token_mean would weight sequences by length."""
    overlong_max_tokens: int | None = Field(None, ge=1)
    """DAPO's overlong reward shaping: L_max, the generated-token length above which an episode
    gets the full penalty; null disables the shaping."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO's L_cache: the penalty grows linearly over the last this-many tokens below L_max."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Scale of DAPO's overlong penalty (1.0 is the paper's: from 0 down to −1)."""
    off_policy: Literal["none", "tis", "decoupled", "mis", "icepop", "seq_tis"] = "tis"
    """Off-policy correction, a detached weight on each token's policy loss from ρ = π_old/π_behav
    (learner over inference server): none (π_old = behaviour, no weight); tis: min(ρ, is_cap);
    decoupled PPO (π_prox recomputed by the learner; ρ above is_cap gets 0); mis: ρ inside
    [mis_low, is_cap], else 0 (masked IS); icepop: ρ inside [icepop_low, icepop_high], else 0
    (IcePop); seq_tis: min(g, is_cap) on every token of a sequence, g the geometric mean of its
    token ratios. See `seq_mask` for dropping whole sequences."""
    is_cap: float = Field(2.0, gt=0)
    """Cap C on importance weights: the truncation of tis and seq_tis, the drop threshold of
    decoupled and the upper bound of mis."""
    mis_low: float = Field(0.0, ge=0)
    """off_policy: mis: ratios below this are masked too; 0 masks only those above is_cap."""
    icepop_low: float = Field(0.5, gt=0)
    """off_policy: icepop: α, the lower end of the kept ratio band (IcePop's 0.5)."""
    icepop_high: float = Field(5.0, gt=0)
    """off_policy: icepop: β, the upper end of the kept ratio band (IcePop's 5)."""
    seq_mask: tuple[float, float] | None = None
    """[lo, hi]: sequences whose geometric-mean ratio g = exp(mean_t log π_old/π_behav) lies outside
    are masked out of the loss whole (SkyRL's geometric sequence mask, verl's geometric rejection
    sampling), with any off_policy; g is near 1, so bands like [0.99, 1.01] are usual. null: off."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL penalty to the reference model; 0 disables the reference model."""
    kl_estimator: Literal["k1", "k3", "low_var_kl"] = "low_var_kl"
    """Estimator of the KL penalty."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""

    @property
    def overlong(self) -> tuple[int, int, float] | None:
        """(L_max, L_cache, factor) of DAPO's overlong shaping, or None when it is off."""
        if self.overlong_max_tokens is None:
            return None
        return self.overlong_max_tokens, self.overlong_buffer_tokens, self.overlong_penalty

    def needs_old_logp(self, mini_batches: int) -> bool:
        """Whether π_old must be recomputed before the update: decoupled PPO's π_prox always; the
        other corrections (and `seq_mask`) when several mini-batches would otherwise read it from
        weights already updated by this batch (with one, π_old is the forward's own detached π)."""
        corrects = self.off_policy != "none" or self.seq_mask is not None
        return self.off_policy == "decoupled" or (corrects and mini_batches > 1)

    @model_validator(mode="before")
    @classmethod
    def _objective_defaults(cls, data: Any) -> Any:
        """GSPO's own aggregation is the sequence mean (GSPO paper, eq. 5-7): it is the default
        when `loss_agg` is not given, so the resolved config names it. CISPO's weight has no
        lower bound unless `clip_low` is given (MiniMax-M1 sets ε_low large)."""
        if isinstance(data, dict) and data.get("policy_loss") == "gspo" and "loss_agg" not in data:
            data = {**data, "loss_agg": "seq_mean_token_mean"}
        if isinstance(data, dict) and data.get("policy_loss") == "cispo" and "clip_low" not in data:
            data = {**data, "clip_low": None}  # MiniMax-M1: no lower bound on CISPO's weight
        return data

    @model_validator(mode="after")
    def _objective_checks(self) -> LossConfig:
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError(
                "kl_estimator: k1 (log π − log π_ref) as a loss term has zero expected gradient on tokens "
                "sampled from π (E[∇ log π] = 0), so the penalty does nothing on average; use k3 or low_var_kl"
            )
        if self.dual_clip is not None and self.policy_loss in ("cispo", "sapo"):
            raise ValueError(
                f"dual_clip: {self.policy_loss} has no clipped surrogate to bound; set it to null"
            )
        if self.clip_low is None and self.policy_loss in ("ppo_clip", "gspo"):
            raise ValueError(
                f"clip_low: {self.policy_loss} needs a lower clip (without it a negative advantage pushes "
                "the ratio down without bound); null is for cispo's one-sided weight"
            )
        if self.policy_loss in ("ppo_clip", "gspo") and self.clip_high < self.clip_low:
            raise ValueError("clip_high: must be >= clip_low (clip-higher widens the upper bound only)")
        if self.off_policy == "mis" and self.mis_low >= self.is_cap:
            raise ValueError("mis_low: must be below is_cap (the kept band of mis is [mis_low, is_cap])")
        if self.off_policy == "icepop" and self.icepop_low >= self.icepop_high:
            raise ValueError("icepop_low: must be below icepop_high (IcePop keeps ratios in [α, β])")
        if self.seq_mask is not None and not 0 < self.seq_mask[0] < self.seq_mask[1]:
            raise ValueError("seq_mask: needs 0 < lo < hi (the kept band of the geometric-mean ratio)")
        if self.overlong_max_tokens is not None and self.overlong_buffer_tokens > self.overlong_max_tokens:
            raise ValueError("overlong_buffer_tokens: must not exceed overlong_max_tokens (L_cache <= L_max)")
        return self


class CriticConfig(Section):
    """PPO's critic (used when `loss.advantage: gae`): a value head on the policy's architecture."""

    model_path: str | None = None
    """Checkpoint the critic's decoder is initialised from; null: the policy's `model_path`. Its
    scalar head is new (zero-initialised), or the checkpoint's own when it is an exported critic."""
    optim: OptimConfig = OptimConfig()
    """The critic's own AdamW, learning rate and clipping."""
    value_clip: float | None = Field(0.2, gt=0)
    """PPO's value clip: values move at most this far from the pre-update values per step; null: none."""
    warmup_steps: int = Field(0, ge=0)
    """Learner steps at the start in which only the critic trains (the actor frozen, no new version)."""
    export: bool = False
    """Also write the critic as a Hugging Face checkpoint (`<run_dir>/hf_critic/`) with the actor's."""


class CheckpointConfig(Section):
    """Resumable checkpoints and Hugging Face exports."""

    every: int = Field(0, ge=0)
    """Save a resumable checkpoint every N steps; 0 saves only at the end."""
    keep: int = Field(2, ge=1)
    """Resumable checkpoints kept on disk (older ones are deleted)."""
    export_every: int = Field(0, ge=0)
    """Write a Hugging Face checkpoint every N steps; 0 exports only at the end."""


class MegatronConfig(Section):
    """The Megatron-core backend's parallel layout (`backend: megatron`); data parallel takes
    the remaining ranks (`num_processes / (tp * pp)`)."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel size: must divide the attention heads, key/value heads and vocabulary."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel stages (Megatron's 1F1B schedule): must divide the decoder layers."""


class MlflowConfig(Section):
    """The MLflow sink of the learner's metrics (`pip install 'agentrl[mlflow]'`)."""

    tracking_uri: str | None = None
    """MLflow tracking store to log the learner's metrics to: `sqlite:///runs/mlflow.db` (a local
    store) or a tracking server's `http://127.0.0.1:5000`; unset, no MLflow."""
    experiment: str = "agentrl"
    """MLflow experiment of the run (created if missing); the run is named `<run_dir name>-learner`."""


class LoggingConfig(Section):
    """Metric sinks beyond `<run_dir>/metrics.jsonl`, transcripts, and the flat-reward warning."""

    tensorboard: bool = False
    """Also write metrics to TensorBoard under `<run_dir>/tensorboard`."""
    wandb_project: str | None = None
    """Also log metrics to this Weights & Biases project."""
    mlflow: MlflowConfig = MlflowConfig()
    """Also log metrics to an MLflow tracking store (`mlflow.tracking_uri`)."""
    transcripts_every: int = Field(10, ge=0)
    """Decode a sample of the batch's episodes into `<run_dir>/transcripts.jsonl` (and the TensorBoard /
    W&B sinks) at the first step and every N steps (`agentrl show transcripts RUN_DIR`); 0 never."""
    transcripts_episodes: int = Field(4, ge=0)
    """Episodes per transcript sample: the lowest and highest reward of the batch, the rest at random."""
    flat_reward_steps: int = Field(10, ge=0)
    """Warn (log and live view) after this many steps in a row whose groups each had all-equal rewards
    (no advantage: nothing to learn from); 0 never."""


class WarmstartConfig(Section):
    """The supervised warm start on the env's demonstrations (`agentrl warmstart`)."""

    steps: int = Field(0, ge=0)
    """Supervised steps on the env's demonstrations before RL; 0 skips it."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the supervised warm start."""
    batch_size: int = Field(16, ge=1)
    """Demonstrations per warm-start step."""


MOVED = {
    **{k: f"optim.{k}" for k in OptimConfig.model_fields},
    **{k: f"schedule.{k}" for k in ScheduleConfig.model_fields},
    **{k: f"loss.{k}" for k in LossConfig.model_fields},
    "checkpoint_every": "checkpoint.every",
    "keep_checkpoints": "checkpoint.keep",
    "export_every": "checkpoint.export_every",
    "tensorboard": "logging.tensorboard",
    "wandb_project": "logging.wandb_project",
    "warmstart_steps": "warmstart.steps",
    "warmstart_lr": "warmstart.lr",
    "warmstart_batch_size": "warmstart.batch_size",
}
"""Old flat `learner.<key>` → its place now (under `learner.`)."""


class MoeConfig(Section):
    """Mixture-of-experts models (agentrl/moe.py)."""

    router_replay: bool = False
    """Router replay (R3): the learner's forward routes each token to the experts the inference
    server routed it to (recorded per token in the episodes; needs `inference.routed_experts: true`),
    the gate weights recomputed from the learner's router for those experts so the router still
    trains. Without it a MoE model's top-k can flip between inference and training, and the
    log-probs disagree by far more than rounding. With it, `moe/mismatch_kl_no_replay` logs what
    the mismatch KL would have been without replay (one more forward per micro-batch, no gradient).
    Learner backends fsdp2, and megatron with `learner.megatron.pp: 1`."""


class LearnerConfig(Section):
    """The learner: model and backend, batch and packing, and its sub-sections."""

    model_path: str = "runs/models/tiny"
    """Hugging Face checkpoint directory (or hub id where a hub is reachable) to train."""
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    """Training backend (`agentrl/learner/backend.py`): FSDP2, or Megatron-core (`megatron`:
    tensor and pipeline parallel; `pip install 'agentrl[megatron]'`; see the README)."""
    megatron: MegatronConfig = MegatronConfig()
    """Tensor and pipeline parallel sizes of `backend: megatron`."""
    groups_per_step: int = Field(8, ge=1)
    """Prompt groups consumed per learner step (the batch size in groups)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per consumed batch (its groups split evenly); > 1 makes π_old differ from π_θ."""
    max_steps: int = Field(100, ge=1)
    """Learner steps (weight versions) to produce before the learner stops."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch (forward/backward unit)."""
    pad_multiple: int = Field(8, ge=1)
    """Packed rows are padded to a multiple of this many tokens (shape reuse on GPUs)."""
    pack_row_tokens: int | None = Field(0, ge=0)
    """Real tokens per packed row of a micro-batch (learner/packing.py). 0: as wide as the
    micro-batch's longest sequence when the model attends with SDPA or eager (a dense
    block-diagonal mask: one row of 16 sequences of 58 tokens trained 2.5x slower than 16 rows
    on CPU), one row under flash attention (varlen); null: always one row; N: rows of at most N
    tokens or the longest sequence."""
    staleness: Literal["group", "token"] = "group"
    """How `max_staleness` is judged. group: a group is trained only while its oldest generated
    token is within the bound, else dropped whole. token: a group stays while any generated token
    is; its tokens older than the bound leave the loss mask and the rest of each episode trains
    (an episode that spans a weight push keeps its newer turns); a group with none left is
    dropped as stale. The masked share is logged as `queue/stale_tokens_masked`. With
    `loss.advantage: gae` masked tokens are not steps, like tool output."""
    max_seq_tokens: int | None = Field(None, ge=2)
    """Episodes longer than this are skipped and counted (`too_long`); null accepts any length."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature the rollers used; logits are divided by it so learner and behaviour
    log-probs describe the same distribution (keep equal to `roller.temperature`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: bfloat16 uses FSDP2 mixed precision (bf16 compute; fp32 master weights,
    AdamW state and gradient reduction; log-probs from an fp32 log-softmax) on CPU and on GPUs
    with bf16 support; a GPU without bf16 trains in float32 and says so."""
    activation_checkpointing: bool = False
    """Recompute activations of each decoder layer in the backward pass."""
    batch_timeout_s: float = Field(5.0, gt=0)
    """How long one wait for a batch lasts before it is logged and retried."""
    max_consecutive_skips: int = Field(20, ge=0)
    """Stop with an error after this many consecutive skipped steps (bad data, NaN); 0 never stops."""
    seed: int = 0
    """Random seed of the learner."""
    num_processes: int = Field(1, ge=1)
    """Learner ranks `agentrl run` starts (torchrun with this many processes when above 1); under
    `backend: megatron` it defaults to megatron.tp x pp."""
    resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each rank asks Ray for, e.g. `{GPU: 1, CPU: 8}` (`CPU`, `GPU` and
    custom resources of `ray start --resources`); the ranks are one placement group, packed per node."""
    optim: OptimConfig = OptimConfig()
    """The actor's AdamW and gradient clipping."""
    schedule: ScheduleConfig = ScheduleConfig()
    """The actor's learning-rate schedule."""
    loss: LossConfig = LossConfig()
    """Advantage estimator and policy objective."""
    critic: CriticConfig = CriticConfig()
    """PPO's critic (`loss.advantage: gae`)."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints and HF exports."""
    logging: LoggingConfig = LoggingConfig()
    """TensorBoard and W&B sinks, transcripts, the flat-reward warning."""
    warmstart: WarmstartConfig = WarmstartConfig()
    """The supervised warm start before RL."""
    distill: DistillConfig = DistillConfig()
    """On-policy distillation from a served teacher (`agentrl/learner/distill.py`); off by default."""
    lora: LoraConfig | None = None
    """Train LoRA adapters on the frozen policy instead of all its weights (`learner/lora.py`;
    with `backend: megatron`, `learner/megatron_lora.py`)."""
    moe: MoeConfig = MoeConfig()
    """Mixture-of-experts settings: router replay."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_flat_keys(cls, data: Any) -> Any:
        """The flat layout's keys fail with the key that replaced each."""
        if isinstance(data, dict):
            moved = [k for k in data if k in MOVED]
            if moved:
                where = "; ".join(f"learner.{k} is now learner.{MOVED[k]}" for k in moved)
                raise ValueError(f"moved keys: {where}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _megatron_ranks(cls, data: Any) -> Any:
        """Under `backend: megatron` an unset `num_processes` is tp x pp (one model replica)."""
        if isinstance(data, dict) and data.get("backend") == "megatron" and "num_processes" not in data:
            m = data.get("megatron") or {}
            m = m.model_dump() if isinstance(m, MegatronConfig) else m
            data = {**data, "num_processes": int(m.get("tp", 1)) * int(m.get("pp", 1))}
        return data

    @model_validator(mode="after")
    def _megatron_layout(self) -> LearnerConfig:
        if self.backend == "megatron" and self.num_processes % (self.megatron.tp * self.megatron.pp):
            raise ValueError(f"num_processes: {self.num_processes} learner ranks cannot hold megatron.tp "
                             f"{self.megatron.tp} x pp {self.megatron.pp}; use a multiple of {self.megatron.tp * self.megatron.pp}")  # fmt: skip
        if self.backend == "megatron" and self.lora is not None and self.lora.modules_to_save:
            raise ValueError(f"lora.modules_to_save {self.lora.modules_to_save}: backend megatron trains adapters "
                             "only; unset it or use backend: fsdp2")  # fmt: skip
        return self
