"""What listeners hear, measured: everything that turns relayed chunks into figures.

* :mod:`proxy.metering.adapters` -- one adapter per upstream protocol, finding the audio
  (or tokens) in each frame or event, and the registry of route protocols.
* :mod:`proxy.metering.session_meter` -- the per-session meter: gaps, delivery ratio,
  time to first audio, playback stalls.
* :mod:`proxy.metering.playback` -- the listener's playback buffer model.
* :mod:`proxy.metering.sketches` -- quantiles in bounded memory.
* :mod:`proxy.metering.rolling` -- rolling per-replica signals the guard reads.
* :mod:`proxy.metering.replica_series` -- a replica's per-chunk series and their export.
* :mod:`proxy.metering.series` -- the Prometheus metrics of the contract.
* :mod:`proxy.metering.scrape` -- gauges read from the gate's state at scrape time.
* :mod:`proxy.metering.loop_lateness` -- how late the event loop runs.

The meters are pure (every call takes the arrival time); only the series touch
prometheus_client.
"""
