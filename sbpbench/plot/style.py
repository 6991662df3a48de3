"""How every figure looks: one colour and marker per method, how estimates, OOMs and the paper are drawn.

Colours are the Okabe-Ito palette (readable with colour-blindness); a method keeps its colour in
every figure. Conventions: measured = solid line / plain bar; simulated = dashed line / hatched
bar, "(estimate)" in its label; the paper's numbers faint (PAPER_ALPHA) in the method's colour;
an OOM is an "x" (skipped = certain OOM, drawn the same).
"""

from __future__ import annotations

import re

from ..settings.choices import METHOD_NAMES

# the registry's order (settings/choices.py), with the paper's MsT beside the paper's three methods
METHOD_ORDER = (*METHOD_NAMES[:2], "mst", *METHOD_NAMES[2:])
METHOD_LABELS = {
    "bp": "bp (w/o ckpt)",
    "ckpt": "ckpt (w/ ckpt)",
    "mst": "MsT (paper only)",
    "streambp": "StreamBP",
    "tiled": "tiled (ALST)",
    "trl-default": "TRL default (ckpt + fused head)",
    "official": "official StreamBP 1.0",
}
METHOD_COLOURS = {
    "bp": "#D55E00",
    "ckpt": "#0072B2",
    "mst": "#CC79A7",
    "streambp": "#009E73",
    "ckpt-offload": "#56B4E9",
    "ckpt-chunked-ce": "#E69F00",
    "tiled": "#000000",
    "liger": "#F0E442",
    "trl-default": "#882255",  # outside Okabe-Ito's eight (all taken): Tol's wine
    "official": "#7F7F7F",
}
METHOD_MARKERS = {
    "bp": "o",
    "ckpt": "s",
    "mst": "^",
    "streambp": "D",
    "ckpt-offload": "P",
    "ckpt-chunked-ce": "X",
    "tiled": "*",
    "liger": "h",
    "trl-default": "p",
    "official": "d",
}
OTHER_COLOUR, OTHER_MARKER = "#7F7F7F", "v"  # a method added later, until it gets its own

ESTIMATE_LINESTYLE, ESTIMATE_HATCH = "--", "//"
PAPER_ALPHA = 0.35
OOM_MARKER = "x"
CAPACITY_STYLE = {"color": "black", "linestyle": "-.", "linewidth": 1.0}
WEIGHTS_GRADS_STYLE = {"color": "#555555", "linestyle": ":", "linewidth": 1.2}

FIGSIZE_IN, DPI = (8.0, 6.0), 100  # every PNG is 800 x 600 pixels
FONT_SIZE, LEGEND_FONT_SIZE = 9, 7


def method_sort_key(method: str) -> tuple:
    return (METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER), method)


def colour(method: str) -> str:
    return METHOD_COLOURS.get(method, OTHER_COLOUR)


def marker(method: str) -> str:
    return METHOD_MARKERS.get(method, OTHER_MARKER)


# StreamBP's checkpoint placements, K left out: the method's colour, a marker each (gpu: the method's)
PLACEMENT_MARKERS = {"cpu": "s", "recompute": "^", "cpu+recompute": "v", "cpu+recompute+spill": "P"}


def placement_marker(placement: str) -> str:
    """ "cpu+recompute:4+spill" -> the marker of cpu+recompute+spill; gpu: StreamBP's."""
    kind = "+".join(word.split(":")[0] for word in placement.split("+"))
    return PLACEMENT_MARKERS.get(kind, METHOD_MARKERS["streambp"])


def shade(colour: str, index: int, count: int) -> str:
    """The index-th of count shades of colour, from the colour itself toward white (at most 60%
    white): one method's bar sets (StreamBP placements, chunk sizes) told apart."""
    if count < 2:
        return colour
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    white = 0.6 * index / (count - 1)
    return "#" + "".join(f"{round(c + (255 - c) * white):02X}" for c in (red, green, blue))


def label(method: str, *, simulated: bool = False, extra: str = "") -> str:
    text = METHOD_LABELS.get(method, method) + (f" {extra}" if extra else "")
    return f"{text} (estimate)" if simulated else text


def file_safe(text: str) -> str:
    """ "NVIDIA H200, limit 80 GiB" -> "NVIDIA-H200-limit-80-GiB": letters, digits, . _ - only."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", str(text)).strip("-") or "unknown"


def thousands(tokens: float) -> str:
    """Token counts as the paper writes them: 4700 -> "4.7k", 110000 -> "110k", 440 -> "440";
    1048576 -> "1.05M"."""
    if tokens >= 999_500:  # "1e+03k" otherwise
        return f"{tokens / 1e6:.3g}M"
    return f"{tokens / 1000:.3g}k" if tokens >= 1000 else f"{tokens:.0f}"
