export PYTHONPATH=src
ncu --query-metrics --chip gh100 > $OUT/metrics_list.txt 2>&1
M=$(grep -oE "^lts__t_(sectors|requests)_(srcunit|srcnode)_[a-z0-9_]+" $OUT/metrics_list.txt | sort -u | sed 's/$/.sum/' | paste -sd, -)
M="$M,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum,lts__t_bytes.sum,gpu__time_duration.sum"
echo "$M" | tr , '\n' | head -40
timeout 200 ncu --clock-control none --profile-from-start off --metrics "$M" python scratch/fwd_ncu.py > $OUT/ncu_l2.txt 2>&1
echo rc=$?
grep -E "^  [a-zA-Z_]|lts__|gpu__" $OUT/ncu_l2.txt | sed 's/  */ /g' | head -150
