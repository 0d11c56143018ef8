"""Tools around the product: start servers (launch) and build the embedded model (tiny_model)."""
