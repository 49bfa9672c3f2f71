"""Graph passes run between capture and the fusion planner; `prepare_graph` runs the standard pipeline."""

from opfuse.passes.cast_precision import cast_precision
from opfuse.passes.eliminate_dead_code import eliminate_dead_code
from opfuse.passes.fold_batchnorm import fold_batchnorm
from opfuse.passes.fold_constants import fold_constants
from opfuse.passes.fold_linear_reshapes import fold_linear_reshapes
from opfuse.passes.manager import PassRecord, default_pipeline, prepare_graph, run_passes
from opfuse.passes.recognize_attention import recognize_attention
from opfuse.passes.recognize_gelu import recognize_gelu
from opfuse.passes.recognize_rms_norm import recognize_rms_norm
from opfuse.passes.recognize_roll import recognize_roll
from opfuse.passes.remove_noop_layout import remove_noop_layout
from opfuse.passes.share_kv_heads import share_kv_heads
from opfuse.passes.simplify_attention_masks import simplify_attention_masks
from opfuse.passes.unshare_views import unshare_views

__all__ = ["cast_precision", "eliminate_dead_code", "fold_batchnorm", "fold_constants", "fold_linear_reshapes",
           "recognize_attention", "recognize_gelu", "recognize_rms_norm", "recognize_roll", "remove_noop_layout",
           "share_kv_heads", "simplify_attention_masks", "unshare_views", "PassRecord", "default_pipeline",
           "prepare_graph", "run_passes"]
