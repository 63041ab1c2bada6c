"""The side-by-side benchmark reads the rows both trees' benchmarks print (today's and 40fe324's formats)."""

from __future__ import annotations

from benchmarks.side_by_side import BENCHES, read_assembly, read_gateway, read_ingest

GATEWAY_NOW = """\
api                  c path        req/s   p50 ms   p99 ms errors  server CPU us/req
chat                 1 direct       3512    0.270    0.412      0                 80
chat                 1 gateway      1780    0.611    0.950      0                420
chat                 1 added    p50 +0.341 ms, p99 +0.538 ms, gateway/direct req/s = 0.51
chat                32 direct      10850    2.811    4.100      0                 60
chat                32 gateway      2613   11.922   20.310      0                330
chat                32 added    p50 +9.111 ms, p99 +16.210 ms, gateway/direct req/s = 0.24
stored spans 3200 for 3200 requests through the gateway (warm-up included): OK
"""
GATEWAY_40FE324 = """\
  c path        req/s   p50 ms   p99 ms errors  server CPU us/req
  1 direct       3400    0.280    0.400      0                 80
  1 gateway      1700    0.620    0.990      0                430
  1 added    p50 +0.340 ms, p99 +0.590 ms, gateway/direct req/s = 0.50
 32 gateway      2467   12.000   21.000      0                340
stored spans 3200 for 3201 requests through the gateway (warm-up included): MISMATCH
"""


def test_reads_the_gateway_rows_of_both_formats() -> None:
    now = read_gateway(GATEWAY_NOW)
    assert now["added p50 ms c=1"] == 0.341 and now["gateway req/s c=32"] == 2613.0
    assert now["direct req/s c=32"] == 10850.0 and now["stored spans ok"] == 1.0
    old = read_gateway(GATEWAY_40FE324)
    assert old["added p50 ms c=1"] == 0.34 and old["gateway req/s c=32"] == 2467.0
    assert old["stored spans ok"] == 0.0


def test_reads_ingest_and_assembly_rows() -> None:
    ingest = read_ingest("sqlite     end to end    36300 spans/s = 1.21x target (x)\n"
                         "postgresql end to end    27100 spans/s = 2.71x target\n")
    assert ingest == {"sqlite spans/s": 36300.0, "postgresql spans/s": 27100.0}
    assert set(ingest) == set(BENCHES["ingest"].targets[""])  # the targets name what is read
    asm = read_assembly("  path                                         1x        10x   ratio\n"
                        "  fetch (CallRecords)                       9,702      8,855   10.96\n"
                        "  fetch+assemble                           44,399     41,257   10.76\n")
    assert asm == {"fetch+assemble spans/s 1x": 44399.0, "fetch+assemble spans/s 10x": 41257.0,
                   "time ratio 10x": 10.76}
    assert read_assembly("nothing") == {}
