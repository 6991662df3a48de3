"""The one way a method says "not here": raise MethodUnsupported with the reason.

A peer whose library is not installed, whose kernels need hardware this point does not have, or
which does not implement the point's objective raises it before doing any work. The worker
(runner/point.py) and the estimator record the point with status "unsupported" and the message as
its error, never a crash and never another method's numbers in its place.
"""

from __future__ import annotations


class MethodUnsupported(RuntimeError):
    """This method cannot run this point here; the message says why and what would make it run."""
