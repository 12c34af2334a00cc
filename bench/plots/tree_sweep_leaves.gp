# written by forkattn bench --plot; render with `gnuplot tree_sweep_leaves.gp` in this directory
set terminal svg size 1400,560 fixed noenhanced font "sans,13" background rgb "white"
set output "tree_sweep_leaves.svg"
set datafile missing "NaN"
set multiplot layout 1,2 title "forkattn bench tree: shape rl, prompt 1024, min-seg 1, max-seg 512, seed 1, heads 4/1, d=64, f32, backend cpu, 2026-11-30 08:45" font ",14"
set grid
set key below
set style textbox opaque noborder
set logscale y 10
set xlabel "leaves L (sequences)"
set logscale x 2
set xrange [1.6:20]
set xtics ("2" 2, "4" 4, "8" 8, "16" 16)
set ylabel "time [ms]"
set title "time (median of 3): fwd+bwd solid, fwd dashed\nlabels: fwd+bwd speedup of tree over replicated"
set yrange [11.2916:2757.88]
set ytics (20, 50, 100, 200, 500, 1000, 2000)
plot "tree_sweep_leaves.dat" using 1:3 with linespoints lw 2 pt 7 ps 1.2 lc rgb "#1f77b4" title "tree fwd+bwd", \
     "" using 1:5 with linespoints lw 2 pt 9 ps 1.2 lc rgb "#2ca02c" title "prompt-only fwd+bwd", \
     "" using 1:7 with linespoints lw 2 pt 5 ps 1.2 lc rgb "#d62728" title "replicated fwd+bwd", \
     "" using 1:2 with linespoints lw 1 dt 2 pt 7 ps 0.8 lc rgb "#1f77b4" title "tree fwd", \
     "" using 1:4 with linespoints lw 1 dt 2 pt 9 ps 0.8 lc rgb "#2ca02c" title "prompt-only fwd", \
     "" using 1:6 with linespoints lw 1 dt 2 pt 5 ps 0.8 lc rgb "#d62728" title "replicated fwd", \
     "" using 1:7:(sprintf("%.2fx", $12)) with labels boxed offset 0,1.1 tc rgb "#d62728" notitle
set ylabel "memory [MiB]"
set title "peak memory: tensors + library workspace"
set yrange [7.86971:226.554]
set ytics (10, 20, 50, 100, 200)
plot "tree_sweep_leaves.dat" using 1:8 with linespoints lw 2 pt 7 ps 1.2 lc rgb "#1f77b4" title "tree", \
     "" using 1:9 with linespoints lw 2 pt 9 ps 1.2 lc rgb "#2ca02c" title "prompt-only", \
     "" using 1:10 with linespoints lw 2 pt 5 ps 1.2 lc rgb "#d62728" title "replicated"
unset multiplot
