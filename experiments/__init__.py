"""How things are measured, in the order data flows: ``sweep`` runs jobs, ``measure`` measures one,
``records`` keeps what it measured, ``report`` turns records into tables and plots."""
