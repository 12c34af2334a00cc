# written by forkattn bench --plot; render with `gnuplot prefix_sweep_p.gp` in this directory
set terminal svg size 1400,560 fixed noenhanced font "sans,13" background rgb "white"
set output "prefix_sweep_p.svg"
set datafile missing "NaN"
set multiplot layout 1,2 title "forkattn bench prefix: N=8, R=128, heads 8/2, d=64, f32, causal, backend cpu, 2026-11-30 08:45" font ",14"
set grid
set key below
set style textbox opaque noborder
set logscale y 10
set xlabel "prompt rows P"
set logscale x 2
set xrange [204.8:2560]
set xtics ("256" 256, "512" 512, "1024" 1024, "2048" 2048)
set ylabel "time [ms]"
set title "time (median of 3): fwd+bwd solid, fwd dashed\nlabels: fwd+bwd speedup of shared over replicated"
set yrange [4.80222:2715.64]
set ytics (5, 10, 20, 50, 100, 200, 500, 1000, 2000)
plot "prefix_sweep_p.dat" using 1:3 with linespoints lw 2 pt 7 ps 1.2 lc rgb "#1f77b4" title "shared fwd+bwd", \
     "" using 1:5 with linespoints lw 2 pt 5 ps 1.2 lc rgb "#d62728" title "replicated fwd+bwd", \
     "" using 1:2 with linespoints lw 1 dt 2 pt 7 ps 0.8 lc rgb "#1f77b4" title "shared fwd", \
     "" using 1:4 with linespoints lw 1 dt 2 pt 5 ps 0.8 lc rgb "#d62728" title "replicated fwd", \
     "" using 1:5:(sprintf("%.2fx", $9)) with labels boxed offset 0,1.1 tc rgb "#d62728" notitle
set ylabel "memory [MiB]"
set title "peak memory: tensors + library workspace"
set yrange [10.1596:223.218]
set ytics (15, 20, 30, 40, 50, 60, 80, 100, 150, 200)
plot "prefix_sweep_p.dat" using 1:6 with linespoints lw 2 pt 7 ps 1.2 lc rgb "#1f77b4" title "shared", \
     "" using 1:7 with linespoints lw 2 pt 5 ps 1.2 lc rgb "#d62728" title "replicated"
unset multiplot
