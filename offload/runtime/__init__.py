"""The runtime layer: what happens to each unit during a micro-step, in the threads and streams
that run it: events and phases (`events`), prefetch order, residency, gradients, the stepper, the
overlap policies, the per-unit schedule and the model's hooks, the gradient window, and the
construction that wires them (`build`)."""
