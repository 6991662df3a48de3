"""A step's memory over time, measured: the timeline file and its kinds (data.py), the samples a
recorder logs (log.py), the phase marks every recorder shares (marks.py), and the two recorders: the
CPU's live-tensor tracker (tracked.py) and a GPU's memory history (cuda.py).

The rest of a timeline's life is elsewhere: runner/timelines.py records and saves one beside a
results CSV, simulate/timeline.py predicts one, workload/timeline.py holds what those two share, and
cli/timeline_table.py and plot/timeline.py show them. Nothing is imported here, so that the file's
format loads without torch.
"""
