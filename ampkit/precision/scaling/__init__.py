"""Loss scaling, one module per job (import each name from the module that defines it):

* ``loss_scaler``: :class:`LossScaler`, ``torch.amp.GradScaler`` with ampkit's extras (one ``step`` for every
  torch of the window); it owns its counts (``ScalerCounts``, a
  :class:`~ampkit.precision.scaling.counters.SkipCounters`) and a
  :class:`~ampkit.precision.scaling.hysteresis.Hysteresis`; ``BackwardUnscale``, the gradients
  ``precision.backward`` unscaled in the fp16 modes whose gradients land in fp32.
* ``counters``: the skip telemetry (skipped/consecutive/last skip/iterations, on the device), the
  skip limit and the parameter names its error gives; their part of the state dict.
* ``hysteresis``: DeepSpeed's rule, back off only after N overflowing steps in a row.
* ``unscale``: unscaling an optimizer's gradients in place while checking them for inf/NaN.
* ``fused``: optimizers that skip inside their kernel, stepped outside a compiled graph where Dynamo would lose
  the hand-over of ``grad_scale``/``found_inf``.
* ``nonfinite``: read-only inf/NaN checks, the one found-inf total, the distributed all-reduce.
* ``step_result``: what a step returns without reading the device (``StepResult``, ``HostCopy``).
"""
