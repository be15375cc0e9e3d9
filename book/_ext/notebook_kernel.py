"""Sphinx extension and shared helper: notebook kernels whose clients poll in slices of a second.

Every place this project executes notebooks uses the kernel manager defined here: the book build
(this module as a Sphinx extension, through jupyter-cache), the notebook tests
(``tests/test_notebooks.py``, through papermill) and ``benchmarks/run_notebooks.py`` (papermill on
the GPU machine).

**Why.** Under load, a notebook cell that moves widgets has waited out the whole cell timeout for an
execute reply the kernel had already sent, and then completed (jupyter/nbclient#312, open): in a
full ``pytest -n 2`` run on two cores, ``labs/gpu_lab.ipynb`` took 250 s where it takes 12-15 s
alone, its 240 s cell timeout plus the cell. nbclient waits for the reply with one
``shell_channel.get_msg(timeout=...)``. The likely cause, read from the code (the stall was not
reproduced on purpose): pyzmq's asyncio poll misses the socket's wake-up but, when its timeout
fires, finds the message with a last ``poll(0)`` (``zmq/_future.py``, ``_AsyncPoller.poll``); a new
poll also looks at the socket's events first. Polling in slices of a second therefore bounds the
stall at a second: the remedy of nbclient's PR #311 (five-second slices), here without patching
nbclient itself.

**How.** :class:`SlicedPollKernelManager` is nbclient's default kernel manager
(``AsyncKernelManager``) whose clients' shell and iopub channels are :class:`SlicedPollChannel`.
papermill takes it as ``kernel_manager_class``. The book build executes notebooks through
jupyter-cache, which calls ``nbclient.execute`` with no way to name a kernel manager, so
:func:`setup` makes jupyter-cache's ``executenb`` pass this one (:func:`install`).
"""

from __future__ import annotations

import functools
import time
from queue import Empty
from typing import Any

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import DottedObjectName, Type


class SlicedPollChannel(AsyncZMQSocketChannel):
    """A kernel channel that waits for a message in polls of at most :attr:`SLICE_S` seconds.

    ``get_msg(timeout=None)`` still waits for ever; a finite timeout still ends in
    ``queue.Empty`` once it has passed (not before it, and at most a slice after it).
    """

    SLICE_S = 1.0

    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self.SLICE_S if deadline is None else min(self.SLICE_S, max(0.0, deadline - time.monotonic()))
            if await self.socket.poll(int(left * 1000)):
                return await self._recv()
            if deadline is not None and time.monotonic() >= deadline:
                raise Empty


class SlicedPollKernelClient(AsyncKernelClient):
    """nbclient's default kernel client with :class:`SlicedPollChannel` shell and iopub channels."""

    shell_channel_class = SlicedPollChannel
    iopub_channel_class = SlicedPollChannel


class SlicedPollKernelManager(AsyncKernelManager):
    """nbclient's default kernel manager, whose clients poll in slices (:class:`SlicedPollChannel`)."""

    client_class = DottedObjectName(f"{__name__}.SlicedPollKernelClient")
    client_factory = Type(SlicedPollKernelClient, klass=AsyncKernelClient)


def install() -> None:
    """Make jupyter-cache execute notebooks with :class:`SlicedPollKernelManager`.

    jupyter-cache's executors call ``jupyter_cache.executors.utils.executenb`` (``nbclient.execute``,
    which passes its keyword arguments to ``NotebookClient``) from ``single_nb_execution``; this
    replaces that name with ``nbclient.execute`` given ``kernel_manager_class``. Idempotent.

    Raises:
        ImportError: jupyter-cache or nbclient is not installed.
    """
    import nbclient
    from jupyter_cache.executors import utils

    if getattr(utils.executenb, "keywords", {}).get("kernel_manager_class") is not SlicedPollKernelManager:
        utils.executenb = functools.partial(nbclient.execute, kernel_manager_class=SlicedPollKernelManager)


def setup(app: Any) -> dict[str, Any]:
    """Sphinx entry point: :func:`install` for this build (myst-nb's ``cache`` execution)."""
    install()
    return {"parallel_read_safe": True, "parallel_write_safe": True}
