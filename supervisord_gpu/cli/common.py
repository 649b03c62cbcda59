"""What every command-line edge shares: one line per error, the documented exit codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..errors import SupervisorError


def guarded(prog: str, fn: Callable[[], int]) -> int:
    """Run `fn`; a SupervisorError becomes one line on stderr and its exit code, never a traceback."""
    try:
        return fn()
    except SupervisorError as e:
        first, _, rest = str(e).partition("\n")
        sys.stderr.write(f"{prog}: {first}\n")
        if rest:
            sys.stderr.write(rest + "\n")
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug of ours: still one line, details only on request
        if os.environ.get("SUPERVISORD_GPU_DEBUG"):
            raise
        sys.stderr.write(f"{prog}: internal error: {e.__class__.__name__}: {e} (set SUPERVISORD_GPU_DEBUG=1 for details)\n")
        return 1
