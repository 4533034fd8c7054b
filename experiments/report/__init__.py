"""Tables, plots and reports rebuilt from records. Imports records, measure (the job kinds, the
canary) and variants (the structure plots); nothing from sweep."""
