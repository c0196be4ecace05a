"""One module per tab: `build(ctx)` lays it out, `wire(ctx)` connects its events once every tab exists,
and live tabs add `live_outputs(ctx)` + `refresh(ctx, seen)` for the periodic update."""
