"""The model layer: cutting a model into units and their flat layouts (`units`), each unit's
run-time state (`unit_state`), real values for a meta-built model (`materialize`), and the model
as its user sees it while an engine owns it (`owned`)."""
