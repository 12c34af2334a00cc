set terminal svg size 1000,420 font 'sans,11'
set output 'dlm_real_weights.svg'
set multiplot layout 1,2
set termoption noenhanced
set title "all-MiniLM-L6-v2 served from the cache\nforkattn 0.2.0, CPU (2 threads), float32"
set xlabel 'requests/s'
set ylabel 'embedding cosine to recomputation'
set grid
set key bottom left
plot 'dlm_real_weights_curve.dat' index 0 using 3:4 with linespoints pt 7 title 'fixed depth b', '' index 0 using 3:4:1 with labels offset 0,0.8 notitle, '' index 1 using 3:4 with points pt 5 ps 1.3 title 'profile depths b(r)', '' index 1 using 3:4:1 with labels left offset 1.2,0 notitle
set title 'prompt K/V drift by layer'
set xlabel 'prefix share r'
set ylabel 'min(K, V) cosine'
set key bottom right
plot 'dlm_real_weights_drift.dat' using 1:2 with linespoints title 'layer 0', 'dlm_real_weights_drift.dat' using 1:3 with linespoints title 'layer 1', 'dlm_real_weights_drift.dat' using 1:4 with linespoints title 'layer 2', 'dlm_real_weights_drift.dat' using 1:5 with linespoints title 'layer 3', 'dlm_real_weights_drift.dat' using 1:6 with linespoints title 'layer 4', 'dlm_real_weights_drift.dat' using 1:7 with linespoints title 'layer 5'
unset multiplot
