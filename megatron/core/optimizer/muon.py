"""Muon for the hidden weight matrices, AdamW for everything else, in one torch optimizer.

Muon (momentum orthogonalized by Newton-Schulz) steps every 2-D parameter that is not an embedding or the output
layer: the linear layers of attention and MLP, experts included (the MoE router too, as upstream). Embeddings
(word and learned position), the output layer, biases and norm weights are stepped by AdamW with the `--adam-*`
settings. Both use the group's `lr` and `weight_decay` (decoupled), which the scheduler sets every step.

One Muon step for a matrix W with gradient G, momentum mu and Newton-Schulz steps k:
    M <- mu M + (1 - mu) G                      (an average, as upstream; `momentum_buffer` in the state)
    U <- (1 - mu) G + mu M  with nesterov, else M
    W <- W (1 - lr wd)
    W <- W - lr * extra_scale * scale(rows, cols) * NS_k(U)
NS_k normalises U by its Frobenius norm (at least 1e-7) and applies k quintic steps
X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315), on the orientation with
fewer rows. `scale` is `spectral` sqrt(max(rows, cols)), `unit_rms_norm` sqrt(rows / cols) or `shape_scaling`
sqrt(max(1, rows / cols)), rows being the output dimension.

With `split_qkv` the fused QKV weight (laid out per query group as q heads, k, v; see attention.py) is
orthogonalized as three matrices, all queries, all keys and all values, each with its own scale.

Tensor parallelism (`tp_mode`), for a weight sharded over the tensor-parallel group:
- `blockwise`: each rank's shard is a matrix of its own, orthogonalized and scaled by its own shape;
- `duplicated`: the shards are all-gathered, the full matrix orthogonalized and this rank's slice kept;
- `distributed`: Newton-Schulz runs on the shards, all-reducing the Gram matrix over the unsharded dimension
  and the norm, never holding the full matrix.
`duplicated` and `distributed` compute the single-rank update (the same polynomial; only rounding differs).

Data-parallel sharding (the distributed optimizer, Megatron-FSDP ZeRO-1..3, FSDP2): momentum and weight decay are
elementwise and stay on each rank's piece; before Newton-Schulz the whole matrix is assembled from the pieces
and the rank keeps its own part of the result, so every layout computes the unsharded update. A DTensor
parameter (FSDP2) is assembled with `full_tensor()` over its mesh. A flat piece (the other two) carries a
`MatrixPiece` (`matrix_piece` attribute, see `mark_matrix_piece`): its elements of the flattened matrix and
the process groups over which the pieces are disjoint and cover it; every rank of those groups holds one piece
of each such matrix (possibly empty), so all take part in the same collectives in the same order. The tensor-parallel
modes then apply to the assembled tensor-parallel shard.

By default (`MuonWithAdamW.distribute_newton_schulz`) each matrix is orthogonalized by one data-parallel rank
only, which sends the result, or each rank's piece of it, to the others (muon_sharing.py): replicated, pieced
over one group or over several (HFSDP), rows over one dimension of an FSDP2 mesh replicated over the others
(HSDP). The weights are bit-equal to assembling and orthogonalizing every matrix on every rank, the path kept
without data parallelism and for DTensors sharded otherwise (logged once when the optimizer is built).

`torch.optim.Muon` implements the same iteration, but in bf16 and without tensor parallelism or the QKV split.
"""

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel_base import is_dtensor
from megatron.core.expert_parameters import is_expert_parameter
from megatron.core.optimizer.muon_sharing import (
    assign_owners,
    flat_piece,
    gather_piece_table,
    newton_schulz_cost,
    orthogonalize_bucket,
    piece_range,
    placement_of,
    unshared_layout,
)
from megatron.core.optimizer.shard_local_adam import ShardLocalAdamW

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")
# --muon-fp32-matmul-prec -> torch.set_float32_matmul_precision on accelerators: bf16 passes, TF32, full fp32.
FP32_MATMUL_PRECISIONS = {"low": "medium", "medium": "high", "high": "highest"}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatrixPiece:
    """A flat main parameter holding elements `[start, end)` of a flattened matrix of `shape`; the pieces over
    the ranks of `groups` (applied one after another; several groups form a grid, as the dimensions of a device
    mesh do) are disjoint and make up the whole matrix. The ranks of `replica_groups` hold the same piece (the
    outer ranks under HSDP); Newton-Schulz is shared over them too, the whole matrix being assembled over
    `groups` alone."""

    shape: Tuple[int, int]
    start: int
    end: int
    groups: tuple
    replica_groups: tuple = ()


def mark_matrix_piece(main_param, shape, start, end, groups, replica_groups=()):
    """Tell Muon that the flat `main_param` is a piece of a matrix (see `MatrixPiece`); 2-D `shape` only."""
    main_param.matrix_piece = MatrixPiece(
        tuple(shape), start, end, tuple(group for group in groups if dist.get_world_size(group) > 1),
        tuple(group for group in replica_groups if dist.get_world_size(group) > 1))


def _whole_matrix(param, update):
    """(the whole matrix of which `update` is `param`'s piece, a function taking a whole matrix to `param`'s
    piece of it); the identity for a parameter that is a whole matrix itself."""
    piece = getattr(param, "matrix_piece", None)
    if piece is not None:
        flat = torch.zeros(math.prod(piece.shape), dtype=torch.float32, device=update.device)
        flat[piece.start:piece.end] = update.reshape(-1)
        for group in piece.groups:  # each element is non-zero on one rank only: the sums are exact
            dist.all_reduce(flat, group=group)
        return flat.view(piece.shape), lambda whole: whole.reshape(-1)[piece.start:piece.end].view_as(param)
    if is_dtensor(update):
        from megatron.core.distributed.torch_fully_sharded_data_parallel import local_shard_like

        # Every rank computes the same whole result: its own piece is cut locally (no collective) and copied to
        # where the shard lives (host memory under --torch-fsdp2-cpu-offload), not via the mesh's device.
        return update.full_tensor(), lambda whole: local_shard_like(update, whole, "a Muon update")
    return update, lambda whole: whole


def _local(tensor):
    """A DTensor's local tensor (itself under no_grad, so stepping it steps the DTensor); any other tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def muon_scale_factor(rows, cols, mode):
    """The update multiplier for an orthogonalized `rows` x `cols` matrix (rows = output dimension)."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"muon scale mode {mode!r} (--muon-scale-mode): choose one of {SCALE_MODES}")


def newton_schulz(matrix, steps, tp_group=None, sharded_dim=None):
    """NS_steps(matrix) in fp32. With `tp_group` and `sharded_dim`, `matrix` is this rank's shard along
    `sharded_dim` of a matrix split over `tp_group`, and the result is the same shard of NS of the whole."""
    a, b, c = NS_COEFFICIENTS
    distributed = tp_group is not None and dist.get_world_size(tp_group) > 1
    # The quintic step is the same polynomial on X and on X^T; put the sharded (or else the longer) side last,
    # so the Gram matrix X X^T is over the unsharded (shorter) side.
    transpose = (sharded_dim == 0) if distributed else matrix.size(0) > matrix.size(1)
    x = matrix.float()
    x = x.T if transpose else x
    square_norm = x.square().sum()
    if distributed:
        dist.all_reduce(square_norm, group=tp_group)
    x = x / square_norm.sqrt().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        if distributed:
            dist.all_reduce(gram, group=tp_group)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transpose else x


def _gather_full(shard, tp_group, dim):
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(pieces, shard.contiguous(), group=tp_group)
    return torch.cat(pieces, dim=dim)


def orthogonalize(update, steps, scale_mode, extra_scale_factor, tp_mode="blockwise", tp_group=None,
                  partition_dim=None):
    """Scaled NS of one matrix; `update` is this rank's shard along `partition_dim` over `tp_group` (or the whole
    matrix when either is None)."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and partition_dim is not None else 1
    if tp_size == 1 or tp_mode == "blockwise":
        orthogonal = newton_schulz(update, steps)
        rows, cols = update.shape
    elif tp_mode == "duplicated":
        full = _gather_full(update, tp_group, partition_dim)
        rank = dist.get_rank(tp_group)
        orthogonal = newton_schulz(full, steps).chunk(tp_size, dim=partition_dim)[rank]
        rows, cols = full.shape
    elif tp_mode == "distributed":
        orthogonal = newton_schulz(update, steps, tp_group, partition_dim)
        rows, cols = update.shape
        rows, cols = (rows * tp_size, cols) if partition_dim == 0 else (rows, cols * tp_size)
    else:
        raise ValueError(f"muon tensor-parallel mode {tp_mode!r} (--muon-tp-mode): choose one of {TP_MODES}")
    return orthogonal * (muon_scale_factor(rows, cols, scale_mode) * extra_scale_factor)


def split_qkv_rows(matrix, qkv_split):
    """The fused QKV rows `[groups, (q | k | v)]` as three matrices (all q rows, all k rows, all v rows)."""
    groups = matrix.size(0) // sum(qkv_split)
    parts = torch.split(matrix.view(groups, sum(qkv_split), matrix.size(1)), list(qkv_split), dim=1)
    return [part.reshape(-1, matrix.size(1)) for part in parts]


def join_qkv_rows(parts, qkv_split):
    groups = parts[0].size(0) // qkv_split[0]
    cols = parts[0].size(1)
    return torch.cat([part.view(groups, size, cols) for part, size in zip(parts, qkv_split)], dim=1).view(-1, cols)


def _tensor_parallel_group(param):
    """(group, partition dim) of a tensor-parallel weight; (None, None) for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False) or getattr(param, "partition_dim", -1) not in (0, 1):
        return None, None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, None
    group = (parallel_state.get_expert_tensor_parallel_group() if is_expert_parameter(param)
             else parallel_state.get_tensor_model_parallel_group())
    if group is None or dist.get_world_size(group) == 1:
        return None, None
    return group, param.partition_dim


@contextlib.contextmanager
def _fp32_matmul_precision(precision, device):
    """The precision of fp32 matmuls on an accelerator; CPU matmuls stay full fp32."""
    if device.type == "cpu":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(FP32_MATMUL_PRECISIONS[precision])
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class MuonWithAdamW(ShardLocalAdamW):
    """AdamW (`ShardLocalAdamW`'s arguments and state) for groups without `use_muon`; Muon for groups with
    `use_muon=True`, whose own keys are `momentum`, `nesterov`, `ns_steps`, `scale_mode`, `extra_scale_factor`,
    `tp_mode`, `fp32_matmul_prec` and `qkv_split` (None, or the q, k, v rows per query group: the group's
    parameters are then fused QKV weights).

    `distribute_newton_schulz` (on by default): each data-parallel rank orthogonalizes a share of the matrices and
    the results are exchanged (see muon_sharing.py); off, every rank orthogonalizes every matrix it steps."""

    distribute_newton_schulz = True
    # Group keys set from this run's flags and model, which a checkpoint's hyperparameters never replace: a run
    # resumed with another --muon-tp-mode (or TP size) or --muon-* value steps as its flags say.
    settings_from_flags = ("use_muon", "momentum", "nesterov", "ns_steps", "scale_mode", "extra_scale_factor",
                           "tp_mode", "fp32_matmul_prec", "qkv_split")

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._piece_tables = {}  # (placement, bucket's parameters) -> PieceTable
        unshared = set()
        for group in self.param_groups:
            if not group.get("use_muon", False):
                continue
            for param in group["params"]:
                if param.dim() != 2 and getattr(param, "matrix_piece", None) is None:
                    raise ValueError(f"Muon steps 2-D weights only; a parameter of shape {tuple(param.shape)} is "
                                     "in a Muon group: give it to AdamW")
                unshared.add(unshared_layout(param))
        for layout in sorted(unshared - {None}):
            logger.warning(f"Muon: weights held as {layout} are assembled and orthogonalized on every rank that "
                           "holds a part of them (Newton-Schulz is shared over data parallel only for matrices "
                           "held whole, as flat pieces, or as rows over one mesh dimension)")

    def load_state_dict(self, state_dict):
        """torch's loading, the groups' `settings_from_flags` kept as they are. The state is matched to the
        parameters by position, so the groups must be laid out as the saved ones."""
        layout = [(len(group["params"]), group.get("use_muon", False)) for group in self.param_groups]
        saved_layout = [(len(group["params"]), group.get("use_muon", False)) for group in state_dict["param_groups"]]
        if layout != saved_layout:
            raise ValueError(
                f"the saved optimizer's parameter groups (size, Muon) {saved_layout} are not this run's {layout}: "
                "its state is matched to the parameters by position, so flags that regroup them (--muon-split-qkv "
                "or --muon-no-split-qkv, --decoupled-lr, the model's layers) must be those of the saved run. Resume "
                "from a --ckpt-format torch_dist checkpoint (matched by parameter name), or pass --no-load-optim.")
        settings = [{key: group[key] for key in self.settings_from_flags if key in group}
                    for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, settings):
            group.update(kept)

    def _muon_state(self, param):
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if "step" not in state:  # a step counter as AdamW keeps: its state loading expects one in every state
            state["step"] = torch.zeros((), dtype=torch.float32)
        return state

    def initialize_state(self):
        """Create the state a first step would create (zero moments and momentum, step 0) without stepping, so
        that a checkpoint can be loaded into it."""
        for group in self.param_groups:
            for param in group["params"]:
                if group.get("use_muon", False):
                    self._muon_state(param)
                else:
                    self._state_of(param, group)

    def _momentum_update(self, group, param):
        """`param`'s update before Newton-Schulz, its momentum stepped (a piece, as `param` is)."""
        state = self._muon_state(param)
        state["step"] += 1
        momentum_buffer = state["momentum_buffer"]
        momentum = group["momentum"]
        # A sharding wrapper's piece without a gradient (an empty one) still takes part in assembling the matrix.
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        momentum_buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(momentum_buffer, momentum) if group["nesterov"] else momentum_buffer

    def _orthogonalize(self, group, param, update):
        """The scaled Newton-Schulz of `update`, the whole matrix of `param` (its tensor-parallel shard)."""
        tp_group, partition_dim = _tensor_parallel_group(param)
        settings = dict(steps=group["ns_steps"], scale_mode=group["scale_mode"],
                        extra_scale_factor=group["extra_scale_factor"], tp_mode=group["tp_mode"], tp_group=tp_group,
                        partition_dim=partition_dim)
        with _fp32_matmul_precision(group["fp32_matmul_prec"], param.device):
            if group.get("qkv_split") is None:
                return orthogonalize(update, **settings)
            if partition_dim not in (None, 0):
                raise ValueError(f"a fused QKV weight split over dimension {partition_dim}: Muon's QKV split "
                                 "needs column-parallel (dimension 0) shards; pass --muon-no-split-qkv")
            qkv_split = group["qkv_split"]
            return join_qkv_rows([orthogonalize(part, **settings) for part in split_qkv_rows(update, qkv_split)],
                                 qkv_split)

    @staticmethod
    def _apply(group, param, orthogonal):
        """Decay `param` and step it by `orthogonal`, its piece of the update, on the local tensors: a DTensor's
        stays where it lives (host memory under --torch-fsdp2-cpu-offload, whose mesh is the GPU's)."""
        param, orthogonal = _local(param), _local(orthogonal)
        if group["weight_decay"] != 0:
            param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(orthogonal.to(device=param.device, dtype=param.dtype), alpha=-group["lr"])

    def _muon_update(self, group, param, update):
        """Assemble `param`'s whole matrix on this rank, orthogonalize it and step `param` by its piece."""
        whole, own_piece = _whole_matrix(param, update)
        self._apply(group, param, own_piece(self._orthogonalize(group, param, whole)))

    def _muon_step(self, group, params, loads):
        """Step the Muon `params` of `group`; `loads`: {placement: each rank's Newton-Schulz cost so far}."""
        updates = [self._momentum_update(group, param) for param in params]
        buckets = {}  # placement -> indices of its matrices, in group order (the same on every rank)
        for index, (param, update) in enumerate(zip(params, updates)):
            placement = placement_of(param, update) if self.distribute_newton_schulz else None
            if placement is None:
                self._muon_update(group, param, update)
            else:
                buckets.setdefault(placement, []).append(index)
        for placement, indices in buckets.items():
            bucket = [params[index] for index in indices]
            pieces, shapes = zip(*(flat_piece(params[index], updates[index]) for index in indices))
            world_size = placement.world_size
            owners = assign_owners([newton_schulz_cost(*shape, group.get("qkv_split")) for shape in shapes],
                                   world_size, loads.setdefault(placement, [0] * world_size))

            def orthogonalize_matrix(position, matrix):
                return self._orthogonalize(group, bucket[position], matrix)

            key = (placement, tuple(id(param) for param in bucket))
            if key not in self._piece_tables:
                self._piece_tables[key] = gather_piece_table(
                    [piece_range(params[index], updates[index]) for index in indices], placement.pieces,
                    pieces[0].device)
            results = orthogonalize_bucket(pieces, shapes, self._piece_tables[key], owners, placement,
                                           orthogonalize_matrix)
            for index, result in zip(indices, results):
                self._apply(group, params[index], result.view_as(_local(updates[index])))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        newton_schulz_loads = {}
        for group in self.param_groups:
            if group.get("use_muon", False):
                # Pieces of sharded matrices step on every rank (their collectives must line up).
                self._muon_step(group, [param for param in group["params"] if param.grad is not None
                                        or getattr(param, "matrix_piece", None) is not None], newton_schulz_loads)
                continue
            self._update(group, [param for param in group["params"] if param.grad is not None], local=False)
        return loss
