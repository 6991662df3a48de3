"""What the measured runner and the estimator share about a point: the model, batch and training
step its spec describes (build.py), and the columns of its results row fixed before it runs, its
key, and those its environment fills (rows.py)."""
