"""The run's guard against a training that goes wrong: what it watches and how the run then ends.

- `finite`: a nan/inf loss or weights (never saved; the run stops or warns, `on_nonfinite`);
- `divergence`: a loss that spikes but stays finite (`SpikeRule`, `on_divergence`);
- `outcome`: how a run ends (`RunOutcome`: a signal, a callback, a divergence), the one place that records it.

The trainer feeds them the losses it already reads; none adds a host read of its own.
"""
