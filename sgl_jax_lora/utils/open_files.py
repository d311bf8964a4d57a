"""The process's limit on open files, raised at the server's start (launch.py), as SGLang and vLLM do.

Every HTTP connection holds an open file until it closes; under the common default soft limit of 1,024 a few
hundred idle or slow clients leave none for the next connection or an adapter's files (accepts fail, silently, and
loads fail with EMFILE). `raise_open_file_limit` lifts the soft limit to the hard one, which an unprivileged process
may do; the operator's hard limit still bounds it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def raise_open_file_limit() -> tuple[int, int] | None:
    """Set RLIMIT_NOFILE's soft limit to its hard limit; -> (before, after), or None where the platform has none."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return soft, soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:  # e.g. macOS caps the soft limit below an unlimited hard one
        logger.warning("could not raise the open-file limit from %d to %d (%s); raise `ulimit -n`", soft, target, e)
        return soft, soft
    return soft, target
