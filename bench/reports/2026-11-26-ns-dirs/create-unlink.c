#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
int main(int argc,char**argv){int n=atoi(argv[2]);char p[4096],buf[4096]={1};struct timespec a,b;
clock_gettime(CLOCK_MONOTONIC,&a);
for(int i=0;i<n;i++){snprintf(p,sizeof p,"%s/f%d",argv[1],i%64);int fd=open(p,O_CREAT|O_WRONLY|O_TRUNC,0644);if(fd<0){perror(p);return 1;}write(fd,buf,sizeof buf);close(fd);if(unlink(p)){perror("unlink");return 1;}}
clock_gettime(CLOCK_MONOTONIC,&b);printf("%.2f us/iter\n",((b.tv_sec-a.tv_sec)*1e9+(b.tv_nsec-a.tv_nsec))/1e3/n);}
