"""``rollout-correction diagnose``: measure the training-inference mismatch in dumped log-probs.

Read a dump (Parquet, JSONL, ``.pt``, ``.npz``; padded or ragged) in a single streaming pass,
compute the core's off-policy metrics and a what-if table of every preset, check the mismatch
against the published health thresholds, recommend a preset, and write a report::

    from rollout_correction.diagnose import diagnose_file, write_report
    diag = diagnose_file("rollouts.parquet")
    write_report(diag, "diagnose_report")
    diag.recommendation.preset
"""

from .diagnosis import Diagnosis, diagnose_file, diagnose_tensors
from .readers import Chunk, Columns
from .sources import iter_chunks
from .report import print_summary, summary_dict, write_report

__all__ = ["Chunk", "Columns", "Diagnosis", "diagnose_file", "diagnose_tensors", "iter_chunks", "print_summary",
           "summary_dict", "write_report"]
