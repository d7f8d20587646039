for i in $(seq 1 80); do
  f=""
  for p in $(pgrep -f netbench_worker); do f="$f $(cut -d' ' -f12 /proc/$p/stat)"; done
  echo "$(date +%T) $(free -m | awk '/Mem/{print "used",$3,"avail",$7}') $(head -1 /proc/pressure/memory) majflt$f"
  sleep 10
done
