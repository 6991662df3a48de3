"""What StreamBP reads of a model: its parts, the features it cannot stream (detectors), the
self-check of an architecture on a small float64 copy, the model's own head, and each layer's
keys and values alone."""
