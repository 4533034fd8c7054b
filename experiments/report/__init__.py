"""Tables, plots and reports rebuilt from records. Imports records and variants; nothing from sweep
or measure."""
