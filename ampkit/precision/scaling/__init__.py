"""Loss scaling, one module per job (import each name from the module that defines it):

* ``loss_scaler``: :class:`LossScaler`, ``torch.amp.GradScaler`` with ampkit's extras; it owns a
  :class:`~ampkit.precision.scaling.counters.SkipCounters` and a
  :class:`~ampkit.precision.scaling.hysteresis.Hysteresis`.
* ``counters``: the skip telemetry (skipped/consecutive/last skip/iterations, on the device), the
  skip limit and the parameter names its error gives; their part of the state dict.
* ``hysteresis``: DeepSpeed's rule, back off only after N overflowing steps in a row.
* ``unscale``: unscaling an optimizer's gradients in place while checking them for inf/NaN.
* ``fused``: torch's protocol for optimizers that skip inside their kernel (found_inf handed over).
* ``nonfinite``: read-only inf/NaN checks, the one found-inf total, the distributed all-reduce.
* ``step_result``: what a step returns without reading the device (``StepResult``, ``HostCopy``).
* ``traceable``: torch's GradScaler step-path methods, written again where ``torch.compile`` traces them.
"""
