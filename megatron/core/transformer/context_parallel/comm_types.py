"""The names of the context-parallel comm types, the per-layer form of `--cp-comm-type`, and the rules that tie a
comm type to the layout (pure validation, no communication).

`--cp-comm-type` takes one value for every layer or one value per layer (in global layer order). `a2a+p2p` is the
hierarchical type: all-to-all over heads inside the inner groups of `--hierarchical-context-parallel-sizes` and a
p2p ring across the outer groups; it needs exactly those two sizes, whose product is the context-parallel size.
Other comm types accept the sizes (as upstream) without using them.
"""

CP_COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")
HIERARCHICAL_COMM_TYPE = "a2a+p2p"
_ALIASES = {"all_gather": "allgather"}


def normalize_cp_comm_type(comm_type):
    """The canonical name of a comm type (upstream spells allgather both ways; None, upstream's default, is p2p);
    ValueError naming the flag."""
    if comm_type is None:
        return "p2p"
    comm_type = _ALIASES.get(comm_type, comm_type)
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {CP_COMM_TYPES} (or all_gather), got {comm_type!r}")
    return comm_type


def normalize_cp_comm_types(cp_comm_type, num_layers):
    """A single comm type (str) for every layer, or a tuple with one per layer.

    `cp_comm_type` is a str or a sequence; a sequence of one value, or of equal values, collapses to that value.
    None (upstream TransformerConfig's default), also as a per-layer entry, is p2p. ValueError naming
    `--cp-comm-type` when a sequence has neither 1 nor `num_layers` entries.
    """
    if cp_comm_type is None or isinstance(cp_comm_type, str):
        return normalize_cp_comm_type(cp_comm_type)
    comm_types = tuple(normalize_cp_comm_type(value) for value in cp_comm_type)
    if len(comm_types) not in (1, num_layers):
        raise ValueError(
            f"--cp-comm-type takes one value for every layer or one per layer (--num-layers {num_layers}), got "
            f"{len(comm_types)} values: {list(cp_comm_type)}"
        )
    return comm_types[0] if len(set(comm_types)) == 1 else comm_types


def comm_type_of_layer(cp_comm_type, layer_number):
    """The comm type of the 1-based global layer `layer_number` (a normalized str or per-layer tuple)."""
    if isinstance(cp_comm_type, str):
        return cp_comm_type
    if not 1 <= layer_number <= len(cp_comm_type):
        raise ValueError(f"layer {layer_number} has no entry in the per-layer --cp-comm-type {list(cp_comm_type)}")
    return cp_comm_type[layer_number - 1]


def comm_types_in_use(cp_comm_type):
    return {cp_comm_type} if isinstance(cp_comm_type, str) else set(cp_comm_type)


def validate_hierarchical_sizes(hierarchical_sizes, context_parallel_size, cp_comm_type):
    """The checked tuple of `--hierarchical-context-parallel-sizes` (inner to outer), or None; ValueError naming the
    flags.

    As upstream, the sizes are required with `a2a+p2p` (exactly two there: the all-to-all size inside, the p2p ring
    size across) and their product must be the context-parallel size; without `a2a+p2p` they are accepted (the
    hierarchical groups are built) and no attention uses them.
    """
    hierarchical = HIERARCHICAL_COMM_TYPE in comm_types_in_use(cp_comm_type)
    if hierarchical_sizes is None:
        if hierarchical:
            raise ValueError(
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes INNER OUTER (all-to-all inside "
                f"groups of INNER ranks, p2p ring across OUTER of them; INNER x OUTER = --context-parallel-size "
                f"{context_parallel_size})"
            )
        return None
    sizes = tuple(hierarchical_sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(
            f"--hierarchical-context-parallel-sizes takes positive integers (inner to outer), got {list(sizes)}"
        )
    if hierarchical and len(sizes) != 2:
        raise ValueError(
            f"--hierarchical-context-parallel-sizes takes two positive integers (the all-to-all size inside, the "
            f"p2p ring size across) for --cp-comm-type a2a+p2p, got {list(sizes)}"
        )
    product = 1
    for size in sizes:
        product *= size
    if product != context_parallel_size:
        raise ValueError(
            f"--hierarchical-context-parallel-sizes {list(sizes)}: the product must equal --context-parallel-size "
            f"({context_parallel_size})"
        )
    return sizes


def heads_split_size(comm_type, context_parallel_size, hierarchical_sizes):
    """Over how many ranks a comm type splits the attention heads (1 when it does not)."""
    if comm_type == "a2a":
        return context_parallel_size
    if comm_type == HIERARCHICAL_COMM_TYPE:
        return hierarchical_sizes[0]
    return 1
