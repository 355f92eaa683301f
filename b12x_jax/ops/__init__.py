"""The collectives: one module per op, each with validation, the public
function, the lowering, and registration, in that order."""
