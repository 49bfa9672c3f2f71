"""The contenders every benchmark compares, by name (no torch import: the command line's help lists them)."""

CONTENDERS = ("eager", "eager_graph", "inductor", "opfuse")
CONTENDER_LABELS = {"eager": "eager", "eager_graph": "eager + CUDA graph",
                    "inductor": "torch.compile + CUDA graph", "opfuse": "opfuse",
                    "opfuse_replay": "opfuse (graph replay)"}
TIMED = (*CONTENDERS, "opfuse_replay")    # opfuse is timed twice: its module call and its bare replay
