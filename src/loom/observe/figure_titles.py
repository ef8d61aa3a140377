"""The figures of `loom report`, in the order the HTML shows them (a leaf: the report and the drawing code,
which imports matplotlib, both read it)."""

__all__ = ["FIGURE_TITLES"]

FIGURE_TITLES = {
    "loss": "Loss per step",
    "throughput": "Throughput over time",
    "heatmap": "Step time per rank (stragglers)",
    "phases": "Where the time goes, per rank",
    "bytes": "Bytes moved per step",
}
"""Figure id -> title (drawn by `loom.observe.report_figures`); the HTML shows them in this order."""
