"""The batch-size tuning panel: the memory plan of a notebook's configuration made interactive (ipywidgets 7.7 on
Colab and 8 elsewhere), with the probe that confirms it on the device and the results it saves.

    from tpu_helpers.panel.widgets import tuning_panel
    tuning_panel(config)                  # sliders for batch, sequence, precision, checkpointing, chips, sharding

Modules: `tuning` (`TuningPanel`, the model behind the view: estimates per choice, what fits, suggestions),
`widgets` (the ipywidgets view), `options` (what the panel offers: slice sizes, the notebooks' configurations,
wording), `suggest` (the settings that would fit), `figure` (the memory bar figure), `background` (the probe run
in a thread), `saving` (a panel from a config, and its results written as a run's). It sits above `memory` (the
estimates it shows) and beside `recipes`: nothing below imports it.
"""
