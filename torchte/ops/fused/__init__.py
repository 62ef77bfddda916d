"""The fusions the fuser applies, in order: forward and backward separately (a forward fusion
fills each basic op's context as the op would, so backward may fuse differently). Each is a
matcher (steps, settings) -> steps over [(op, indices of its basic ops)], in its own file."""

from .activation_linear import fuse_activation_linear
from .backward_activation_linear import fuse_backward_activation_linear
from .grouped_mlp import fuse_grouped_mlp, fuse_grouped_mlp_backward
from .linear_add import fuse_linear_add
from .linear_bias import fuse_linear_bias
from .norm_linear import fuse_norm_linear

# Producer fusions first: they take the Bias after their GEMM along.
FORWARD_FUSIONS = (
    fuse_grouped_mlp,
    fuse_norm_linear,
    fuse_activation_linear,
    fuse_linear_add,
    fuse_linear_bias,
)
BACKWARD_FUSIONS = (fuse_grouped_mlp_backward, fuse_backward_activation_linear)

__all__ = ["BACKWARD_FUSIONS", "FORWARD_FUSIONS"]
