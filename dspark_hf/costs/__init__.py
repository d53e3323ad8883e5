"""Machine measurement: what the engine's steps cost on this machine, measured (`profile`: SPS by batch size, the
draft's pass, what such figures are keyed on) and modelled (`cost_model`: `EngineCosts`, the `dspark profile` files,
the on-disk cache of measured costs). The verification policies price their rounds with it; it knows no policy."""
