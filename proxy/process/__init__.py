"""The ``headroom`` process: commands, serving, workers and their supervisor.

* :mod:`proxy.process.cli` -- the ``headroom`` command and its subcommands.
* :mod:`proxy.process.gateway` -- one gateway process: listeners, signals, drain, reload.
* :mod:`proxy.process.serving` -- uvicorn inside an already running event loop.
* :mod:`proxy.process.workers`, :mod:`proxy.process.worker_control`,
  :mod:`proxy.process.reload_rounds` -- ``serve --workers N``: the supervisor, the
  control channel, reload rounds over every worker.
* :mod:`proxy.process.admin` -- the admin listener (reload, drain, status).
* :mod:`proxy.process.demo` -- ``headroom demo``: the simulator and a gateway in front.
* :mod:`proxy.process.healthcheck`, :mod:`proxy.process.console`,
  :mod:`proxy.process.eventloop` -- the healthcheck command, operator lines on
  standard error, how each command runs its event loop.

Nothing below this package imports it, except that the simulator and the probe run
their servers through :mod:`proxy.process.serving`.
"""
