# The PNG plots of RESULTS.md from report.py's plot_data/*.dat (run by benchmarks/run_all
# in the output folder: gnuplot -e "dir='OUT'" benchmarks/plots.gp). Points are medians,
# error bars min and max over repetitions.
set terminal pngcairo size 800,500 noenhanced
set grid
set key top left
data(name) = dir . "/plot_data/" . name . ".dat"
# Whether a data file has rows (a filtered run leaves some empty).
has(name) = system("grep -qv '^#' " . data(name) . " 2>/dev/null && echo 1 || echo 0") eq "1"
strategy(i) = word("NO_SHARD SHARD_GRAD_OP FULL_SHARD", i + 1)

if (has("memory")) {
  set output dir . "/memory.png"
  set title "Per-rank peak memory of model state (GPT width 128): measured vs REFERENCE §5"
  set xlabel "world size W"
  set ylabel "MB"
  set logscale x 2
  set xrange [0.8:5]
  plot for [i=0:2] data("memory") using 1:($2 == i ? $3 : NaN):4:5 \
         with yerrorlines lw 2 title strategy(i) . " measured", \
       for [i=0:2] data("memory") using 1:($2 == i ? $6 : NaN) \
         with linespoints dt 2 title strategy(i) . " formula"
  unset logscale x
}

if (has("traffic")) {
  set output dir . "/traffic.png"
  set title "Bytes sent per rank per step: counters, lo and REFERENCE §4"
  set ylabel "MB per step"
  set xrange [1.5:4.5]
  plot for [i=0:2] data("traffic") using 1:($2 == i ? $6 : NaN):7:8 \
         with yerrorlines lw 2 title strategy(i) . " lo", \
       for [i=0:2] data("traffic") using 1:($2 == i ? $3 : NaN) \
         with points pt 6 ps 2 title strategy(i) . " counters", \
       for [i=0:2] data("traffic") using 1:($2 == i ? $9 : NaN) \
         with linespoints dt 2 title strategy(i) . " formula"
  set xrange [*:*]
}

if (has("scaling")) {
  set output dir . "/scaling_time.png"
  set title "Step time vs model size, W = 2"
  set xlabel "parameters (millions)"
  set ylabel "ms per step"
  plot data("scaling") using 1:2:3:4 with yerrorlines lw 2 title "FULL_SHARD", \
       data("scaling") using 1:5:6:7 with yerrorlines lw 2 title "NO_SHARD"
}

if (has("scaling")) {
  set output dir . "/scaling_memory.png"
  set title "Per-rank peak memory vs model size, W = 2"
  set ylabel "MB"
  plot data("scaling") using 1:8:9:10 with yerrorlines lw 2 title "FULL_SHARD measured", \
       data("scaling") using 1:11:12:13 with yerrorlines lw 2 title "NO_SHARD measured", \
       data("scaling") using 1:14 with linespoints dt 2 title "FULL_SHARD formula", \
       data("scaling") using 1:15 with linespoints dt 2 title "NO_SHARD formula"
}

if (has("planner")) {
  set output dir . "/planner.png"
  set title "plan_fsdp_units: time per module"
  set xlabel "modules"
  set ylabel "ns per module"
  set logscale x
  set yrange [0:*]
  plot data("planner") using 1:($5 == 0 ? $2 : NaN):3:4 with yerrorlines lw 2 title "wide", \
       data("planner") using 1:($5 == 1 ? $2 : NaN):3:4 with yerrorlines lw 2 title "deep"
}

if (has("AllGather")) {
  set output dir . "/busbw.png"
  set title "Bus bandwidth, W = 2, Gloo over loopback"
  set xlabel "bytes per rank"
  set ylabel "busbw (GB/s)"
  set logscale x 2
  plot data("AllGather") using 1:2:3:4 with yerrorlines lw 2 title "all-gather", \
       data("ReduceScatter") using 1:2:3:4 with yerrorlines lw 2 title "reduce-scatter"
}
