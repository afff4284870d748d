"""One real call: the plan, the in-place guard, outputs, devices and streams."""
