# The PNG plots of RESULTS.md from report.py's plot_data/NAME_CURVE.dat files (run by
# benchmarks/run_all: gnuplot -e "dir='OUT'" benchmarks/plots.gp). Points are medians,
# error bars min and max over repetitions; a curve whose file is missing (a filtered run)
# is left out.
set terminal pngcairo size 800,500 noenhanced
set grid
set key outside right top
data(name) = dir . "/plot_data/" . name . ".dat"
# Whether any NAME_*.dat or NAME.dat file exists.
has(name) = system("ls " . dir . "/plot_data/" . name . "*.dat >/dev/null 2>&1 && echo 1 || echo 0") eq "1"
strategies = "NO_SHARD SHARD_GRAD_OP FULL_SHARD"
present(name) = system("test -f " . data(name) . " && echo 1 || echo 0") eq "1"
# A file's name, or an empty file's when the curve is missing (plots nothing, no error).
curve(name) = present(name) ? data(name) : "/dev/null"

if (has("memory")) {
  set output dir . "/memory.png"
  set title "Per-rank peak memory (GPT width 128): measured vs REFERENCE §5"
  set xlabel "world size W"
  set ylabel "MB"
  set logscale x 2
  set xrange [0.8:5]
  set yrange [0:*]
  plot for [s in strategies] curve("memory_" . s) using 1:2:3:4 \
         with yerrorlines lw 2 title s . " measured", \
       for [s in strategies] curve("memory_" . s) using 1:5 \
         with linespoints dt 2 title s . " formula"
  unset logscale x
  set xrange [*:*]
}

if (has("traffic")) {
  set output dir . "/traffic.png"
  set title "Bytes sent per rank per step: lo counter and REFERENCE §4"
  set xlabel "world size W"
  set ylabel "MB per step"
  set xrange [1.5:4.5]
  set yrange [0:*]
  plot for [s in strategies] curve("traffic_" . s) using 1:5:6:7 \
         with yerrorlines lw 2 title s . " lo", \
       for [s in strategies] curve("traffic_" . s) using 1:8 \
         with linespoints dt 2 title s . " formula"
  set xrange [*:*]
}

if (has("scaling")) {
  set output dir . "/scaling_time.png"
  set title "Step time vs model size, W = 2"
  set xlabel "parameters (millions)"
  set ylabel "ms per step"
  set yrange [0:*]
  plot data("scaling_W2") using 1:2:3:4 with yerrorlines lw 2 title "FULL_SHARD", \
       data("scaling_W2") using 1:5:6:7 with yerrorlines lw 2 title "NO_SHARD"

  set output dir . "/scaling_memory.png"
  set title "Per-rank peak memory vs model size, W = 2"
  set ylabel "MB"
  plot data("scaling_W2") using 1:8:9:10 with yerrorlines lw 2 title "FULL_SHARD measured", \
       data("scaling_W2") using 1:11:12:13 with yerrorlines lw 2 title "NO_SHARD measured", \
       data("scaling_W2") using 1:14 with linespoints dt 2 title "FULL_SHARD formula", \
       data("scaling_W2") using 1:15 with linespoints dt 2 title "NO_SHARD formula"
}

if (has("planner")) {
  set output dir . "/planner.png"
  set title "plan_fsdp_units: time per module"
  set xlabel "modules"
  set ylabel "ns per module"
  set logscale x
  set yrange [0:*]
  plot for [s in "wide deep"] curve("planner_" . s) using 1:2:3:4 \
         with yerrorlines lw 2 title s
  unset logscale x
}

if (has("busbw")) {
  set output dir . "/busbw.png"
  set title "Bus bandwidth, W = 2, Gloo over loopback"
  set xlabel "bytes per rank"
  set ylabel "busbw (GB/s)"
  set logscale x 2
  set yrange [0:*]
  plot for [op in "AllGather ReduceScatter C10dAllGather C10dReduceScatter"] \
         curve("busbw_" . op) using 1:2:3:4 with yerrorlines lw 2 title op
  unset logscale x
}

if (has("peer")) {
  set output dir . "/peer.png"
  set title "Tokens/s, fsdp and PyTorch (FSDP2, or DDP for NO_SHARD), CPU over Gloo"
  set xlabel ""
  set ylabel "tokens/s"
  set yrange [0:*]
  set style data histograms
  set style histogram clustered gap 1
  set style fill solid 0.8 border -1
  set xtics rotate by -40 font ",8"
  plot data("peer_tokens") using 2:xtic(1) title "fsdp", '' using 3 title "PyTorch"
}
