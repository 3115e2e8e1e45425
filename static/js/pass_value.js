// Copies an input's value to the outputs in the browser, with no server call; app/tabs/explore/features_panel.py.
(f) => f
