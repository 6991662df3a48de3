"""Measurement: the CPU live-tensor-bytes tracker (GPU memory and timing come with `sbp run`)."""
