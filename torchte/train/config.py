"""What a training run is made of: the model's shape, the size presets and the run's settings.

ModelConfig is what a checkpoint must match to be resumed; RunConfig holds everything else a
run needs (steps, batch, learning rate, data, outputs). Both are frozen dataclasses that check
their values in __post_init__ and raise ValueError with a message naming the option.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 256  # byte-level: one token per byte
FP8_MULTIPLE = 16  # FP8 GEMMs need every dimension, token counts included, divisible by 16
RECIPES = ("bf16", "delayed", "current", "block", "mxfp8", "nvfp4")
COMPUTE_DTYPES = ("bf16", "fp32")
GATHER_DTYPES = ("fp32", "bf16")  # --fsdp-gather-dtype
DEFAULT_MAX_BYTES = 64 * 2**20  # corpus cap: reading stops once this many bytes are kept
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# te.LayerNormMLP's activations less clamped_swiglu (which takes parameters)
ACTIVATIONS = (
    "gelu", "geglu", "glu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu",
    "swiglu",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """The GPT's shape. A checkpoint resumes only into a model of the same ModelConfig."""

    hidden: int
    """Width of the residual stream."""
    layers: int
    """Number of transformer blocks."""
    heads: int
    """Attention heads; hidden must be divisible by it."""
    ffn: int
    """Hidden width of the MLP (of each expert's MLP with experts)."""
    seq_len: int
    """Tokens per sequence (also the number of learned positions)."""
    experts: int = 0
    """0: a dense te.LayerNormMLP per block; N >= 1: a mixture of N experts."""
    top_k: int = 2
    """Experts each token is routed to (with experts)."""
    vocab: int = VOCAB_SIZE
    """Vocabulary size: 256 bytes."""
    normalization: str = "LayerNorm"
    """The blocks' and the final norm: "LayerNorm" or "RMSNorm"."""
    activation: str = "gelu"
    """The MLP's activation (te.LayerNormMLP's names: gelu, swiglu, ...); gated ones (swiglu,
    geglu, ...) make FC1 twice as wide."""
    rope: bool = False
    """Rotary position embeddings on queries and keys instead of learned positions."""
    gqa_groups: int = 0
    """Key/value head groups (grouped-query attention); 0 means one per head (= heads)."""
    packed: bool = False
    """Each sequence row holds several documents (the corpus's files), and attention stays
    within each (qkv_format "thd" with cu_seqlens); positions restart at every document."""

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "ffn", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.gqa_groups == 0:  # frozen: the resolved count is what a checkpoint records
            object.__setattr__(self, "gqa_groups", self.heads)
        if self.gqa_groups < 0 or self.heads % self.gqa_groups:
            raise ValueError(
                f"--gqa-groups must divide the head count {self.heads}, got {self.gqa_groups}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got "
                f"{self.normalization}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"--activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation}"
            )
        if self.rope and (self.hidden // self.heads) % 2:
            raise ValueError(
                f"--rope turns channel pairs: the head size hidden / heads = "
                f"{self.hidden // self.heads} must be even"
            )
        if self.experts < 0:
            raise ValueError(f"--experts must be at least 1, got {self.experts}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"--top-k must be between 1 and --experts ({self.experts}), got {self.top_k}; "
                "lower --top-k or raise --experts"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden // self.heads

    def as_dict(self) -> dict[str, int | str | bool]:
        """The fields as a plain dict (what a checkpoint stores)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SizePreset:
    """A model size and the training defaults that go with it."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float


SIZES: dict[str, SizePreset] = {
    # About 0.5M parameters: the CPU default, the same on every CPU so that runs compare.
    # Without FP8 and with FP8 delayed scaling back to back: about a minute on 2 cores of a
    # Xeon, both where bf16 is fast (AMX: bf16 compute) and where it is emulated (AVX2 only:
    # fp32 compute); the emulated FP8 step takes 1.5-2x the other's. 300 steps take the
    # validation loss from 5.6 to about 2.2.
    "tiny": SizePreset(128, 2, 4, 512, 128, 16, 300, 2e-3),
    "small": SizePreset(256, 4, 4, 1024, 256, 16, 1000, 1e-3),
    "medium": SizePreset(512, 8, 8, 2048, 512, 16, 2000, 6e-4),
    # About 355M parameters: the GPU default. Wide and shallow (7 blocks of width 2048, 16K
    # tokens a step), so the GEMMs are large enough for FP8 to pay and the GPU, not the host,
    # sets the pace; 28 blocks of width 1024 at 8K tokens leave each GEMM small. lr 2e-4: on an
    # H200, 1000 steps reached a lower validation loss than 3e-4, with less spread over seeds
    # (loss 1.20 and 1.21 for seeds 0 and 1); at 6e-4 and 1e-3 the loss stays near 2.4 for
    # most of the run.
    "large": SizePreset(2048, 7, 16, 8192, 1024, 16, 1000, 2e-4),
}


@dataclass(frozen=True)
class RunConfig:
    """Everything about a run beyond the model's shape."""

    recipes: tuple[str, ...]
    """Recipes run back to back, each from the same seed and data order."""
    device: str
    """"cpu" or "cuda"."""
    steps: int
    """Optimizer steps per recipe (the total: a resumed run continues up to it)."""
    batch_size: int
    """Sequences per step."""
    lr: float
    """Peak learning rate of AdamW (linear warmup, then cosine decay to lr / 10)."""
    warmup: int
    """Warmup steps."""
    seed: int
    """Seed of the initial weights and of the batch order."""
    log_every: int
    """Steps between logged rows (train loss averaged over them, tokens/s)."""
    eval_every: int
    """Steps between validation losses (also at step 0 and at the last step)."""
    eval_batches: int
    """Validation batches, the same for every recipe."""
    data: Path | None
    """A text file or a folder; None: the Python standard library's source files."""
    max_bytes: int
    """Corpus cap in bytes."""
    out: Path
    """Folder for the CSV and the plot."""
    save: Path | None = None
    """Checkpoint written at the end (and every save_every steps)."""
    save_every: int = 0
    """0: save at the end only."""
    resume: Path | None = None
    """Checkpoint to continue from."""
    stop_at: int | None = None
    """Stop after this step (of the schedule of `steps`), to resume later; None: run to the
    end."""
    tp: int = 1
    """Tensor-parallel ranks (processes started by torchrun)."""
    sequence_parallel: bool = False
    """With tp > 1: each rank holds its rows of the batch between the split layers."""
    cp: int = 1
    """Context-parallel ranks (processes started by torchrun): every rank trains on the same
    rows of each batch, each on its load-balanced share of every sequence (chunks r and
    2 cp - 1 - r of 2 cp); the weights stay whole on every rank, their gradients summed."""
    ep: int = 1
    """Expert-parallel ranks (processes started by torchrun): each holds its share of every
    MoE layer's experts and trains on its share of every batch (ep_run.py)."""
    fsdp: bool = False
    """Sharded data parallelism (FSDP2) over the processes torchrun started; checkpoints are
    torch.distributed.checkpoint folders."""
    fp8_all_gather: bool = False
    """With fsdp: the FP8 recipes' te modules shard and gather their weights as FP8."""
    fsdp_gather_dtype: str = "fp32"
    """With fsdp: what FSDP2 all-gathers the parameters in: "fp32" (the master weights as they
    are) or "bf16" (cast before the gather, gradients reduced in fp32: half the bytes; the
    embeddings' outputs, and so the residual stream, are then bf16). Weights gathered as FP8
    (fp8_all_gather) go as FP8 either way."""
    fsdp_keep_gathered: bool = False
    """With fsdp: each block keeps its gathered weights from its forward to its backward
    (FSDP2's reshard_after_forward=False), so the backward gathers nothing: half the
    all-gathers and their host work, for the memory of the whole gathered model (ZeRO-2's)."""
    optimizer: str = "adamw"
    """"adamw": ClippedAdamW (torch's AdamW state, clipping and update fused on a GPU);
    "fused-adam": te.optimizers.FusedAdam after torch's clip_grad_norm_, one process
    (optimizer_choice.py)."""
    master_weights: bool = False
    """With fused-adam: the model's weights in bf16, their fp32 masters in the optimizer."""
    adam_moments: str = "fp32"
    """With fused-adam: AdamW's moments stored in "fp32" or "bf16"."""
    compute_dtype: str = "bf16"
    """"bf16" (torch.autocast) or "fp32" (autocast off): what the model computes in besides
    FP8 GEMMs; see precision.py."""
    compute_reason: str = ""
    """Why that dtype (the option, or what the device does fast), for the log and the table."""
    threads: int | None = None
    """CPU threads torch computes with (torch.set_num_threads; threads.py); None: torch's
    default, left alone."""
    threads_reason: str = ""
    """Why that count (the option, the environment, or what a probe found), for the log."""
    cuda_graph: bool = False
    """Capture the transformer blocks' forwards and backwards as CUDA graphs (cuda_graph.py):
    one process, not packed. On the CPU the same code runs the blocks eagerly (what the tests
    use; the command line refuses it there)."""
    cuda_graph_reason: str = ""
    """Why graphs are on or off (the option, or what auto found), for the log."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.save_every < 0:
            raise ValueError(f"--save-every must be 0 or more, got {self.save_every}")
        if self.stop_at is not None and self.stop_at < 1:
            raise ValueError(f"--stop-at must be positive, got {self.stop_at}")
        if self.stop_at is not None and self.stop_at > self.steps:
            raise ValueError(
                f"--stop-at {self.stop_at} is past --steps {self.steps} (the end of the "
                "schedule): give a --stop-at of at most --steps, or raise --steps"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)}, got "
                f"{self.compute_dtype}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if self.max_bytes < 1:
            raise ValueError(f"--max-bytes must be positive, got {self.max_bytes}")
        if self.cuda_graph and (self.tp > 1 or self.fsdp or self.ep > 1 or self.cp > 1):
            raise ValueError(
                "--cuda-graph on captures one process's blocks: it does not go with --tp, "
                "--ep, --cp or --fsdp; use --cuda-graph off"
            )
        if self.fsdp_gather_dtype not in GATHER_DTYPES:
            raise ValueError(
                f"--fsdp-gather-dtype must be one of {', '.join(GATHER_DTYPES)}, got "
                f"{self.fsdp_gather_dtype}"
            )

    @property
    def last_step(self) -> int:
        """The step this process trains up to."""
        return self.steps if self.stop_at is None else min(self.steps, self.stop_at)

    @property
    def uses_fp8(self) -> bool:
        """Whether any of the recipes runs in FP8."""
        return any(name != "bf16" for name in self.recipes)

    def label(self, recipe: str) -> str:
        """The name a recipe's run goes by in the log, table, CSV and plot: the FP8 recipe's
        name, or for the run without FP8 ("bf16") the dtype it computed in."""
        return self.compute_dtype if recipe == "bf16" else recipe

    def computes(self, recipe: str) -> str:
        """What a recipe's run computes in: "bf16" or "fp32", or "fp8+" either under FP8
        (FP8 GEMMs, the rest in the compute dtype)."""
        return self.compute_dtype if recipe == "bf16" else f"fp8+{self.compute_dtype}"
